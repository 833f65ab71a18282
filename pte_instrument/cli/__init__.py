"""The ``pte`` command line (offline; never loaded by vLLM)."""
