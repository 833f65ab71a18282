"""The only package that knows vLLM internals (its stats classes are not a stable API).

``scheduler`` runs in the engine-core process, ``stat_logger`` and ``endpoints`` in each
API server, ``plugin`` in every vLLM process, ``compat`` (every read of vLLM's config and
request naming) in both; ``serve`` is the ``vllm serve`` launcher."""
