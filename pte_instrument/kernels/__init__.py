"""Batched step-accumulator kernels (issue 3).

``reference``      numpy: the meaning, and the CPU backend (imports numpy only)
``torch_backend``  the same arithmetic on torch tensors (CPU or CUDA)
``triton_backend`` one Triton kernel (CUDA; CPU tensors run under the Triton interpreter)

Only ``reference`` is imported here: torch and triton are optional, and
``pte_instrument.accumulator`` imports their backends lazily, when one is chosen.
"""

from .reference import (
    CTX0,
    DECODE_TOKENS,
    FIELDS,
    N_FIELDS,
    N_FIXED,
    PREFILL,
    RECOMPUTE,
    REJECTED_TOKENS,
    SPEC_TOKENS,
    UNLIMITED,
    column_names,
    n_columns,
    served_pte,
    step_contributions,
    window_array,
)

__all__ = [
    "CTX0",
    "DECODE_TOKENS",
    "FIELDS",
    "N_FIELDS",
    "N_FIXED",
    "PREFILL",
    "RECOMPUTE",
    "REJECTED_TOKENS",
    "SPEC_TOKENS",
    "UNLIMITED",
    "column_names",
    "n_columns",
    "served_pte",
    "step_contributions",
    "window_array",
]
