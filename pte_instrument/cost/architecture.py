"""Read a model's architecture from a Hugging Face config: KV-cache bytes read per
context token at decode, and active matmul parameters per token (docs/cost-model.md §3).

Pure functions over a plain ``dict``; no vLLM, no transformers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Field aliases used by families that predate the Llama naming.
_ALIASES: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size", "n_embd", "d_model", "model_dim"),
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "num_attention_heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
    "num_key_value_heads": ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"),
    "intermediate_size": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"),
    "vocab_size": ("vocab_size", "padded_vocab_size"),
}
# Families whose MLP is a plain up/down projection rather than a gated (SwiGLU) one.
_UNGATED_MLP = {"gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "phi", "starcoder2", "gpt_bigcode"}
KV_DTYPE_BYTES: dict[str, float] = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
    "int8": 1,
    "fp8_ds_mla": 1,
}


# An N_active override outside this is no model: a single weight at least, and 10^14 is far
# above any model built; outside it γ underflows or overflows.
N_ACTIVE_MIN = 1.0
N_ACTIVE_MAX = 1e14
# Config sizes above 2^53 are no longer exact as floats (and no real model has them).
_MAX_SIZE = 2**53
# Windows are listed per layer: a layer count far past any model's would exhaust memory.
MAX_LAYERS = 10**6


class ArchitectureError(ValueError):
    """The config lacks what the cost model needs; the message names the fields."""


class _NonFiniteNumber(ValueError):
    """A JSON number the cost model cannot use: NaN, ±Infinity or past float range."""


@dataclass(frozen=True)
class KVGroup:
    """Layers that read the same amount of KV per context token, up to ``window`` tokens."""

    layers: int
    bytes_per_token: float  # summed over the group's layers
    window: int | None  # None: full attention


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    attention: str  # "mha", "gqa", "mqa" or "mla"
    kv_dtype_bytes: float
    kv_groups: tuple[KVGroup, ...]
    n_active: float  # matmul weights used per token (LM head included, embedding lookup not)
    n_total: float  # all matmul weights (every expert), the weight bytes read per step
    moe_experts: int = 0
    moe_experts_per_token: int = 0
    assumed: tuple[str, ...] = ()  # fields the config lacked, each with the value assumed

    @property
    def kv_bytes_per_token(self) -> float:
        """KV bytes read per context token at full context (windows not applied)."""
        return sum(g.bytes_per_token for g in self.kv_groups)

    @classmethod
    def from_kv_groups(
        cls, model_type: str, kv_groups: tuple[KVGroup, ...], n_active: float, n_total: float | None = None
    ) -> ModelShape:
        """A shape known only by what pricing needs (KV groups and weights), not by its
        layers: a γ given directly, or a step log's header."""
        return cls(
            model_type,
            0,
            0,
            0,
            0,
            0,
            "unknown",
            0.0,
            kv_groups,
            n_active,
            n_active if n_total is None else n_total,
        )


def config_file(path: str | Path) -> Path:
    """The model config a model directory or a file path names."""
    p = Path(path)
    return p / "config.json" if p.is_dir() else p


def load_config(path: str | Path) -> dict[str, Any]:
    """Load ``config.json`` from a model directory or a file path."""
    p = config_file(path)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ArchitectureError(f"cannot read model config {p}: not UTF-8 text") from None
    except OSError as e:
        raise ArchitectureError(f"cannot read model config {p}: {e.strerror or e}") from None
    try:
        cfg = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except ValueError as e:  # a JSONDecodeError, a non-finite number, or an integer past 4300 digits
        raise ArchitectureError(f"{p} is not valid JSON: {e}") from None
    except RecursionError:  # the json module recurses once per nesting level
        raise ArchitectureError(f"{p} is not valid JSON: nested too deeply") from None
    if not isinstance(cfg, dict):
        raise ArchitectureError(f"{p} must hold a JSON object, got {type(cfg).__name__}")
    return cfg


def _reject_constant(literal: str) -> float:
    # Python's json accepts NaN and Infinity; the JSON standard and the cost model do not.
    raise _NonFiniteNumber(f"{literal} is not a finite number")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):  # e.g. 1e400, which float() turns into inf
        raise _NonFiniteNumber(f"{literal} is out of range")
    return value


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    # Multimodal wrappers (Llava, Gemma3, Qwen-VL…) keep the language model in text_config.
    inner = cfg.get("text_config") or cfg.get("language_config") or cfg.get("llm_config")
    if isinstance(inner, dict) and any(k in inner for k in _ALIASES["hidden_size"]):
        merged = {k: v for k, v in cfg.items() if k != "text_config"}
        merged.update(inner)
        return merged
    return cfg


def _get(cfg: dict[str, Any], name: str) -> Any:
    for alias in _ALIASES.get(name, (name,)):
        if cfg.get(alias) is not None:
            return cfg[alias]
    return None


def _require(cfg: dict[str, Any], names: list[str]) -> dict[str, Any]:
    values = {n: _get(cfg, n) for n in names}
    missing = [n for n, v in values.items() if v is None]
    if missing:
        kind = cfg.get("model_type", "<no model_type>")
        hint = "; ".join(
            f"{n} (or {', '.join(_ALIASES[n][1:])})" if n in _ALIASES and len(_ALIASES[n]) > 1 else n
            for n in missing
        )
        raise ArchitectureError(
            f"model_type {kind!r}: config lacks field(s) needed for the cost model: {hint}"
        )
    bad = [n for n, v in values.items() if not (_is_size(v) and v >= 1)]
    if bad:
        raise ArchitectureError(f"config field(s) must be whole numbers ≥ 1: {', '.join(bad)}")
    return values


def _whole(cfg: dict[str, Any], *names: str) -> int | None:
    """The first of ``names`` set in the config, as a whole number ≥ 1; None: none set (0
    counts as unset, as configs write "none" with 0 or null)."""
    for name in names:
        v = _get(cfg, name)
        if v is None or v is False or v == 0:
            continue
        if not _is_size(v) or v < 1:
            shown = repr(v) if len(repr(v)) <= 40 else f"{repr(v)[:40]}…"
            raise ArchitectureError(f"config field {name} must be a whole number ≥ 1, got {shown}")
        return int(v)
    return None


def _is_size(v: Any) -> bool:
    # NaN fails both comparisons; bool is an int but never a size; 3.7 heads are no heads
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < _MAX_SIZE and v == int(v)


def kv_dtype_bytes(dtype: str | None, default: float = 2) -> float:
    """Bytes per KV element for a vLLM ``--kv-cache-dtype`` or a torch dtype name."""
    if dtype is None or dtype in ("auto", ""):
        return default
    name = str(dtype).removeprefix("torch.").lower()
    if name.startswith("fp8") or name.startswith("float8"):
        return 1
    if name not in KV_DTYPE_BYTES:
        raise ArchitectureError(
            f"unknown KV cache dtype {dtype!r}; known: {', '.join(sorted(KV_DTYPE_BYTES))}"
        )
    return KV_DTYPE_BYTES[name]


def _layer_windows(cfg: dict[str, Any], n_layers: int) -> list[int | None]:
    """Per layer: the sliding window in tokens, or None for full attention."""
    window = _whole(cfg, "sliding_window")
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list) and len(layer_types) == n_layers:
        return [window if "sliding" in str(t) and window else None for t in layer_types]
    if not window:
        return [None] * n_layers
    if cfg.get("model_type") in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        # Qwen: sliding only when use_sliding_window, and only above max_window_layers.
        if not cfg.get("use_sliding_window"):
            return [None] * n_layers
        first = n_layers if cfg.get("max_window_layers") is None else _whole(cfg, "max_window_layers") or 0
        return [None if i < first else window for i in range(n_layers)]
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 0:
        # Gemma-style: every pattern-th layer is global.
        return [None if (i + 1) % pattern == 0 else window for i in range(n_layers)]
    return [window] * n_layers


def _group_layers(per_layer: list[tuple[float, int | None]]) -> tuple[KVGroup, ...]:
    groups: dict[int | None, list[float]] = {}
    for nbytes, window in per_layer:
        groups.setdefault(window, []).append(nbytes)
    return tuple(
        KVGroup(layers=len(v), bytes_per_token=float(sum(v)), window=w)
        for w, v in sorted(groups.items(), key=lambda kv: (kv[0] is not None, kv[0] or 0))
    )


def parse_shape(
    cfg: dict[str, Any],
    kv_cache_dtype: str | None = None,
    n_active_override: float | None = None,
) -> ModelShape:
    """Derive the cost-relevant shape of a model from its Hugging Face config."""
    cfg = _text_config(cfg)
    model_type = str(cfg.get("model_type", "unknown"))
    v = _require(cfg, ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"])
    d, n_layers, n_heads, vocab = (
        int(v["hidden_size"]),
        int(v["num_hidden_layers"]),
        int(v["num_attention_heads"]),
        int(v["vocab_size"]),
    )
    if n_layers > MAX_LAYERS:
        raise ArchitectureError(
            f"config field num_hidden_layers must be at most {MAX_LAYERS:g}, got {n_layers}"
        )
    is_mla = cfg.get("kv_lora_rank") is not None
    assumed: list[str] = []  # said in one warning line, and shown beside γ
    n_kv = _whole(cfg, "num_key_value_heads") or n_heads
    if cfg.get("multi_query") is True:  # gpt_bigcode / falcon flag
        n_kv = 1
    elif _get(cfg, "num_key_value_heads") is None and not is_mla:
        # A remote-code model may name it otherwise; MHA is the largest KV it can have.
        assumed.append("num_key_value_heads missing: assumed = num_attention_heads (MHA)")
    head_dim = _whole(cfg, "head_dim") or d // n_heads
    if head_dim < 1:  # no KV bytes at all: γ would be 0
        raise ArchitectureError(f"config lacks head_dim, and hidden_size {d} < num_attention_heads {n_heads}")
    model_dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    if model_dtype is None and kv_cache_dtype in (None, "auto", ""):
        assumed.append("torch_dtype missing: assumed bfloat16 (2 bytes per KV element)")
    kv_bytes = kv_dtype_bytes(kv_cache_dtype, default=kv_dtype_bytes(str(model_dtype or "bfloat16")))

    # --- attention weights and KV bytes per layer ---
    if is_mla:
        mla = _require(cfg, ["kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"])
        rank, rope, nope, vdim = (
            int(mla[k]) for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
        )
        q_rank = _whole(cfg, "q_lora_rank")
        q_w = d * q_rank + q_rank * n_heads * (nope + rope) if q_rank else d * n_heads * (nope + rope)
        attn_w = q_w + d * (rank + rope) + rank * n_heads * (nope + vdim) + n_heads * vdim * d
        layer_kv = (rank + rope) * kv_bytes  # one shared latent, not K and V
        attention = "mla"
        head_dim = nope + rope
    else:
        attn_w = d * n_heads * head_dim + 2 * d * n_kv * head_dim + n_heads * head_dim * d
        layer_kv = 2 * n_kv * head_dim * kv_bytes
        attention = "mha" if n_kv == n_heads else ("mqa" if n_kv == 1 else "gqa")

    # --- MLP weights per layer (dense and MoE) ---
    gated = model_type not in _UNGATED_MLP
    mats = 3 if gated else 2
    ffn = _whole(cfg, "intermediate_size")
    n_experts = _whole(cfg, "n_routed_experts", "num_local_experts", "num_experts") or 0
    top_k = _whole(cfg, "num_experts_per_tok", "moe_topk", "top_k") or 0
    if n_experts and not top_k:
        raise ArchitectureError(f"model_type {model_type!r}: MoE config lacks num_experts_per_tok")
    moe_ffn = _whole(cfg, "moe_intermediate_size") or ffn
    if ffn is None and not n_experts and not gated:
        ffn = 4 * d
        assumed.append("intermediate_size missing: assumed 4 × hidden_size (ungated MLP)")
    if ffn is None and not moe_ffn:
        raise ArchitectureError(
            f"model_type {model_type!r}: config lacks field(s) needed for the cost model: intermediate_size"
        )
    dense_mlp = mats * d * ffn if ffn else 0
    n_dense_layers = n_layers
    moe_active = moe_total = 0.0
    if n_experts:
        shared = _whole(cfg, "n_shared_experts") or 0
        shared_ffn = _whole(cfg, "shared_expert_intermediate_size")
        assert moe_ffn is not None  # refused above when neither size is given
        shared_w = mats * d * shared_ffn if shared_ffn else shared * mats * d * moe_ffn
        expert_w = mats * d * moe_ffn
        router = d * n_experts
        moe_active = shared_w + top_k * expert_w + router
        moe_total = shared_w + n_experts * expert_w + router
        n_dense_layers = min(_whole(cfg, "first_k_dense_replace") or 0, n_layers)
        step = _whole(cfg, "decoder_sparse_step") or 1
        n_moe_layers = n_layers - n_dense_layers
        if step > 1:  # Qwen-MoE style: only every step-th layer is sparse
            n_moe_layers = n_layers // step
            n_dense_layers = n_layers - n_moe_layers
    else:
        n_moe_layers = 0

    lm_head = d * vocab
    n_active = n_layers * attn_w + n_dense_layers * dense_mlp + n_moe_layers * moe_active + lm_head
    n_total = n_layers * attn_w + n_dense_layers * dense_mlp + n_moe_layers * moe_total + lm_head
    if n_total > N_ACTIVE_MAX:  # no model built: its γ would be a vanishing number
        raise ArchitectureError(
            f"model_type {model_type!r}: the config gives {n_total:.3g} weights, past any model "
            f"(N_active at most {N_ACTIVE_MAX:g})"
        )
    if n_active_override is not None:
        if not N_ACTIVE_MIN <= n_active_override <= N_ACTIVE_MAX:  # NaN fails both comparisons
            raise ArchitectureError(
                f"N_active override must be a number from {N_ACTIVE_MIN:g} to {N_ACTIVE_MAX:g}, "
                f"got {n_active_override!r}"
            )
        n_active = float(n_active_override)
        n_total = max(n_total, n_active)

    windows = _layer_windows(cfg, n_layers)
    groups = _group_layers([(layer_kv, w) for w in windows])
    return ModelShape(
        model_type=model_type,
        n_layers=n_layers,
        hidden_size=d,
        n_heads=n_heads,
        n_kv_heads=1 if is_mla else n_kv,
        head_dim=head_dim,
        attention=attention,
        kv_dtype_bytes=kv_bytes,
        kv_groups=groups,
        n_active=float(n_active),
        n_total=float(n_total),
        moe_experts=n_experts,
        moe_experts_per_token=top_k,
        assumed=tuple(assumed),
    )
