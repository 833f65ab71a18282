"""Latency validation bench (docs/cost-model.md §6): does PTE track wall-clock time better than
token counts?

- ``driver``  tool-integrated-reasoning agent sessions against an OpenAI-compatible server
- ``run``     the CPU-vLLM bench: model, server, workload phases, then the analysis of
              ``pte_instrument.validation`` on its logs, with the bench's phases

Run from the repository root: ``python -m bench.latency.run --help`` (or ``pte bench latency``).
"""
