"""Latency validation: does PTE, and do the seconds the plugin attributes, track wall-clock
time, and better than token counts? The analysis of a server's request log and step log,
used by ``pte validate`` and by the latency bench (docs/latency-bench.md).

- ``analysis``    the logs as tables; correlations with bootstrap intervals at step, request
                  and turn level, against token-count baselines
- ``seconds``     request seconds: attribution, latency explained, requests matched across phases
- ``step_model``  the four-term step-time model scored on the step log (fit, theory, error by term)
- ``calibrate``   γ fitted from measured step times, beside γ from theory
- ``report``      targets, diagnoses, JSON, markdown and plots
"""
