"""The PTE cost model (docs/cost-model.md §1–3): γ from a model shape and a device profile,
and the three PTE variants of a turn and a trajectory.

Every function here accepts numpy arrays as well as scalars, so the live path and the
offline reports share one formula.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from pte_instrument.cost.architecture import ModelShape, parse_shape
from pte_instrument.cost.devices import DeviceProfile, resolve_device


@dataclass(frozen=True)
class GammaGroup:
    gamma: float  # PTE per context token per decoded token, for this layer group
    window: int | None  # the group reads at most this many context tokens


@dataclass(frozen=True)
class CostModel:
    """γ for one (model, hardware) pair: γ = KV_bytes_per_token · HOI / (2 · N_active)."""

    shape: ModelShape
    device: DeviceProfile

    @property
    def groups(self) -> tuple[GammaGroup, ...]:
        scale = self.device.hoi / (2.0 * self.shape.n_active)
        return tuple(GammaGroup(g.bytes_per_token * scale, g.window) for g in self.shape.kv_groups)

    @property
    def gamma(self) -> float:
        """γ at full context (sliding windows not applied)."""
        return sum(g.gamma for g in self.groups)

    def decode_reference(self, context: Any, tokens: Any) -> Any:
        """Reference decode term γ·L·D (windows cap L per group)."""
        return sum(g.gamma * _capped(context, g.window) * tokens for g in self.groups)

    def decode_exact(self, context: Any, tokens: Any) -> Any:
        """Exact decode term γ·Σ_{j<D} (L + j), each group capped at its window."""
        return sum(g.gamma * context_sum(context, tokens, g.window) for g in self.groups)

    def describe(self) -> dict[str, Any]:
        s = self.shape
        return {
            "gamma": self.gamma,
            "gamma_groups": [{"gamma": g.gamma, "window": g.window} for g in self.groups],
            "kv_bytes_per_token": s.kv_bytes_per_token,
            "n_active": s.n_active,
            "n_total": s.n_total,
            "hoi": self.device.hoi,
            "device": self.device.name,
            "device_source": self.device.source,
            "peak_flops": self.device.peak_flops,
            "mem_bandwidth": self.device.mem_bandwidth,
            "model_type": s.model_type,
            "attention": s.attention,
            "n_layers": s.n_layers,
            "n_heads": s.n_heads,
            "n_kv_heads": s.n_kv_heads,
            "head_dim": s.head_dim,
            "kv_dtype_bytes": s.kv_dtype_bytes,
            "moe_experts": s.moe_experts,
            "moe_experts_per_token": s.moe_experts_per_token,
            "assumed": list(s.assumed),  # config fields the shape had to assume
        }


def cost_model_for(
    config: dict[str, Any],
    kv_cache_dtype: str | None = None,
    device: str | None = "auto",
    hoi: float | None = None,
    n_active: float | None = None,
) -> CostModel:
    """The cost model of a served model (its Hugging Face config, with the dtype served) on a
    device (a name, ``auto`` to detect it, or a HOI of its own)."""
    return CostModel(
        parse_shape(config, kv_cache_dtype=kv_cache_dtype, n_active_override=n_active),
        resolve_device(device, hoi),
    )


def _capped(context: Any, window: int | None) -> Any:
    return context if window is None else np.minimum(context, window)


def context_sum(context: Any, tokens: Any, window: int | None = None) -> Any:
    """Σ_{j=0}^{D-1} min(L + j, W): the context tokens read while decoding D tokens."""
    L = np.asarray(context, dtype=np.float64)
    D = np.asarray(tokens, dtype=np.float64)
    full = D * L + D * (D - 1) / 2
    if window is None:
        return _scalar(full)
    W = float(window)
    m = np.clip(W - L, 0, D)  # steps before the context reaches the window
    capped = m * L + m * (m - 1) / 2 + (D - m) * W
    return _scalar(np.where(L + D - 1 <= W, full, capped))


def _scalar(x: np.ndarray) -> Any:
    return float(x) if np.ndim(x) == 0 else x


@dataclass(frozen=True)
class TurnTokens:
    """What one turn (one request) processed, in tokens."""

    prompt_tokens: int  # L_seq: context length when decoding starts
    output_tokens: int  # D_decode
    cached_tokens: int = 0  # prefix-cache hits: never computed
    recomputed_tokens: int = 0  # re-prefilled after preemption or KV loss
    reusable_tokens: int = 0  # context the previous turn of the session already paid for

    @property
    def computed_prefill_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True)
class TurnCost:
    """PTE of a turn under the three variants of docs/cost-model.md §2, split by phase."""

    reference_prefill: float
    reference_decode: float
    served_prefill: float
    served_decode: float
    ideal_prefill: float
    recompute: float  # part of served_prefill spent on recomputation

    @property
    def reference(self) -> float:
        return self.reference_prefill + self.reference_decode

    @property
    def served(self) -> float:
        return self.served_prefill + self.served_decode

    @property
    def ideal(self) -> float:
        return self.ideal_prefill + self.served_decode

    @property
    def eviction_tax(self) -> float:
        """Prefill of context the previous turn had already paid for (never negative:
        cache hits beyond that context, e.g. a prefix shared across sessions, are not a tax)."""
        return max(0.0, self.served_prefill - self.recompute - self.ideal_prefill)

    def __add__(self, other: TurnCost) -> TurnCost:
        return TurnCost(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


ZERO_COST = TurnCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def price_turn(model: CostModel, t: TurnTokens) -> TurnCost:
    if min(t.prompt_tokens, t.output_tokens, t.cached_tokens, t.recomputed_tokens, t.reusable_tokens) < 0:
        raise ValueError(f"token counts must be non-negative: {t}")
    if t.cached_tokens > t.prompt_tokens:
        raise ValueError(f"cached_tokens {t.cached_tokens} exceed prompt_tokens {t.prompt_tokens}")
    L, D = t.prompt_tokens, t.output_tokens
    return TurnCost(
        reference_prefill=float(L),
        reference_decode=float(model.decode_reference(L, D)),
        served_prefill=float(L - t.cached_tokens + t.recomputed_tokens),
        served_decode=float(model.decode_exact(L, D)),
        ideal_prefill=float(L - min(t.reusable_tokens, L)),
        recompute=float(t.recomputed_tokens),
    )


def reusable_prefix(prev_prompt: int, prev_output: int, prompt: int, block_size: int = 1) -> int:
    """Context of the previous turn a prefix cache could still hold for this one: every
    token the previous turn computed (its prompt and all outputs but the last, which was
    sampled and never fed back), in whole KV blocks, and no longer than this prompt.
    Assumes an agent loop, whose prompts extend the previous prompt and output."""
    computed = prev_prompt + max(prev_output - 1, 0)
    return min(prompt, computed - computed % block_size)


def session_turns(
    prompts: Sequence[int],
    outputs: Sequence[int],
    cached: Sequence[int] | None = None,
    recomputed: Sequence[int] | None = None,
    block_size: int = 1,
) -> list[TurnTokens]:
    """The turns of one session, each inheriting the previous turn's reusable prefix."""
    n = len(prompts)
    cached = cached if cached is not None else [0] * n
    recomputed = recomputed if recomputed is not None else [0] * n
    return [
        TurnTokens(
            prompts[i],
            outputs[i],
            cached[i],
            recomputed[i],
            reusable_prefix(prompts[i - 1], outputs[i - 1], prompts[i], block_size) if i else 0,
        )
        for i in range(n)
    ]


def price_trajectory(model: CostModel, turns: Sequence[TurnTokens]) -> TurnCost:
    """PTE = Σ_i (D_prefill_i + γ · decode_i) over a trajectory's turns."""
    total = ZERO_COST
    for t in turns:
        total = total + price_turn(model, t)
    return total
