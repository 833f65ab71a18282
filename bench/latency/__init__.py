"""Latency validation bench (docs/cost-model.md §6): does PTE track wall-clock time better than
token counts?

- ``driver``     tool-integrated-reasoning agent sessions against an OpenAI-compatible server
- ``analysis``   correlations with bootstrap intervals at step, request and turn level (numpy only)
- ``calibrate``  γ fitted from measured step times, beside γ from theory
- ``report``     JSON, markdown and PNG plots
- ``run``        the CPU-vLLM bench: model, server, workload, analysis, report

Run from the repository root: ``python -m bench.latency.run --help`` (or ``pte bench latency``).
"""
