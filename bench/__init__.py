"""Benchmarks, offline: each runs as ``python -m bench.<name>`` from the repository root and saves its numbers under ``bench/results/``. Never loaded by vLLM."""
