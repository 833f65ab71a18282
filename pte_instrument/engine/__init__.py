"""Runs in vLLM's engine-core process (one per data-parallel rank)."""
