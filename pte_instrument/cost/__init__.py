"""The cost model and ledgers: plain Python/numpy, no vLLM and no exporter imports."""
