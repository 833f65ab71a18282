"""pte-instrument: what each vLLM request and agent session costs the GPU, in PTE.

One package per process (README, *How it works*): ``engine`` runs in vLLM's engine core,
``server`` in each API server, ``vllm_adapter`` is the only code that imports vLLM (split
the same way), ``cost`` is shared by all, ``offline``, ``cli`` and ``devtools`` never load
inside vLLM. ``settings``, ``wire``, ``transport`` and ``faults`` serve both processes."""
