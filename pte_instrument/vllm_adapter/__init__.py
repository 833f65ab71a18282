"""The only package that knows vLLM internals (its stats classes are not a stable API)."""
