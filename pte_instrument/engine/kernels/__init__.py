"""Batched step-accumulator kernels (docs/cost-model.md §4).

``reference``      numpy: the meaning, and the CPU backend (imports numpy only)
``torch_backend``  the same arithmetic on torch tensors (CPU or CUDA)
``triton_backend`` one Triton kernel (CUDA; CPU tensors run under the Triton interpreter)

Import the module you need (``from pte_instrument.engine.kernels import reference as ref``):
torch and triton are optional, and ``pte_instrument.engine.accumulator`` imports their backends
lazily, when one is chosen.
"""
