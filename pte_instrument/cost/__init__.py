"""The cost model (architecture, device profiles, γ and the PTE formulas): imported by the
engine core, the API servers and the offline tools alike. Plain Python/numpy: no vLLM, no
exporter, nothing of either process."""
