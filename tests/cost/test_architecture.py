"""γ inputs from config.json fixtures; every expectation below is worked out by hand."""

from pathlib import Path

import pytest

from pte_instrument.cost.architecture import ArchitectureError, load_config, parse_shape
from pte_instrument.cost.devices import PROFILES, DeviceProfile, resolve_device
from pte_instrument.cost.model import CostModel

FIX = Path(__file__).parents[1] / "fixtures"


def shape(name: str, **kw):
    return parse_shape(load_config(FIX / f"{name}.json"), **kw)


def test_dense_mha():
    s = shape("dense_mha")
    # KV: 4 layers · 2 (K,V) · 4 kv heads · 64 head_dim · 2 bytes = 4096
    assert s.kv_bytes_per_token == 4096
    assert s.attention == "mha" and s.head_dim == 64
    # per layer: attn 4·256·256 = 262144, gated MLP 3·256·512 = 393216 → 655360 · 4 layers
    # + LM head 256·1000 = 256000 → 2,877,440
    assert s.n_active == 2_877_440


def test_gqa_with_explicit_head_dim():
    s = shape("gqa_head_dim")
    # head_dim 128 although hidden/heads = 32: 2 layers · 2 · 2 kv · 128 · 2 B = 2048
    assert s.head_dim == 128 and s.attention == "gqa"
    assert s.kv_bytes_per_token == 2048
    # attn: q 256·1024 + k,v 2·256·256 + o 1024·256 = 655360; MLP 393216; ·2 + 256000
    assert s.n_active == 2 * (655_360 + 393_216) + 256_000


def test_mqa_fp32_ungated():
    s = shape("mqa_fp32")
    # multi_query → 1 kv head; fp32 → 4 B: 3 · 2 · 1 · 32 · 4 = 768
    assert s.attention == "mqa" and s.kv_dtype_bytes == 4
    assert s.kv_bytes_per_token == 768
    # attn 128·128·2 + 2·128·32 = 40960; ungated MLP with default 4·d: 2·128·512 = 131072
    assert s.n_active == 3 * (40_960 + 131_072) + 128 * 500


def test_moe_mixtral_active_vs_total():
    s = shape("moe_mixtral")
    # attn 49152; expert 3·128·256 = 98304; router 128·8 = 1024
    # active: 2 layers · (49152 + 2·98304 + 1024) + LM 12800 = 506368
    assert s.n_active == 506_368
    assert s.n_total == 2 * (49_152 + 8 * 98_304 + 1_024) + 12_800
    assert s.kv_bytes_per_token == 2 * 2 * 1 * 64 * 2


def test_mla_latent_kv_and_shared_experts():
    s = shape("mla_deepseek")
    # latent: (kv_lora_rank 32 + rope 16) · 2 B = 96 per layer, one latent (not K and V)
    assert s.attention == "mla"
    assert s.kv_bytes_per_token == 3 * 96
    # attn 29184 per layer; 1 dense layer MLP 98304; 2 MoE layers:
    # shared 24576 + 2 routed · 24576 + router 512 = 74240; LM 12800 → 347136
    assert s.n_active == 347_136


def test_sliding_window_groups():
    s = shape("sliding_gemma2")
    groups = {g.window: (g.layers, g.bytes_per_token) for g in s.kv_groups}
    assert groups == {None: (2, 512), 8: (2, 512)}
    m = CostModel(s, DeviceProfile("unit", peak_flops=100.0, mem_bandwidth=1.0, source="test"))
    g = 512 * 100 / (2 * 602_624)  # per group γ
    assert m.gamma == pytest.approx(2 * g, rel=1e-12)
    # L = 10, D = 3: full group reads 10+11+12 = 33, window group min(·, 8)·3 = 24
    assert m.decode_exact(10, 3) == pytest.approx(g * 33 + g * 24, rel=1e-12)
    assert m.decode_reference(10, 3) == pytest.approx(g * 30 + g * 24, rel=1e-12)


def test_fp8_kv_cache_halves_gamma():
    bf16 = CostModel(shape("dense_mha"), PROFILES["h100-sxm"])
    fp8 = CostModel(shape("dense_mha", kv_cache_dtype="fp8"), PROFILES["h100-sxm"])
    assert fp8.shape.kv_bytes_per_token == 2048
    assert fp8.gamma == pytest.approx(bf16.gamma / 2, rel=1e-12)


def test_llama31_8b_worked_example():
    """docs/cost-model.md §3: 32 layers, d 4096, 32 q / 8 kv heads, N ≈ 8.0e9, HOI 756.5 → γ ≈ 0.0062."""
    s = shape("llama31_8b", n_active_override=8.0e9)
    m = CostModel(s, resolve_device("h100-pcie-sparse"))
    assert m.device.hoi == pytest.approx(756.5)
    # 32 · 2 · 8 · 128 · 2 B = 131072 B; 131072 · 756.5 / (2 · 8e9) = 0.006197248
    assert s.kv_bytes_per_token == 131_072
    assert m.gamma == pytest.approx(0.006197248, rel=1e-9)
    assert round(m.gamma, 4) == 0.0062
    # the published closed form 2·n_layers·d·HOI/N·(H_kv/H_q) agrees
    assert m.gamma == pytest.approx(2 * 32 * 4096 * 756.5 / 8.0e9 * (8 / 32), rel=1e-12)
    # from the config alone: N_active = 32·(41,943,040 + 176,160,768) + 525,336,576
    assert parse_shape(load_config(FIX / "llama31_8b.json")).n_active == 7_504_658_432


def test_unknown_model_type_with_aliased_fields_works():
    s = shape("unknown_complete")
    assert s.model_type == "brand_new_arch"
    assert s.kv_bytes_per_token == 2 * 2 * 1 * 64 * 2
    assert s.n_active == 2 * (49_152 + 98_304) + 12_800


def test_unknown_model_type_names_missing_fields():
    with pytest.raises(ArchitectureError) as e:
        shape("unknown_partial")
    msg = str(e.value)
    assert "brand_new_arch" in msg
    for field in ("num_attention_heads", "vocab_size"):
        assert field in msg
    assert "hidden_size" not in msg  # n_embd was read as its alias


def test_bad_values_are_named():
    with pytest.raises(ArchitectureError, match="num_hidden_layers"):
        parse_shape({"hidden_size": 64, "num_hidden_layers": 0, "num_attention_heads": 1, "vocab_size": 10})
    with pytest.raises(ArchitectureError, match="unknown KV cache dtype"):
        shape("dense_mha", kv_cache_dtype="int3")


# (fixture, field): each field the cost model reads beyond the four it requires
OPTIONAL_FIELDS = [
    ("dense_mha", "intermediate_size"),
    ("dense_mha", "num_key_value_heads"),
    ("sliding_gemma2", "head_dim"),
    ("sliding_gemma2", "sliding_window"),
    ("mla_deepseek", "q_lora_rank"),
    ("mla_deepseek", "n_routed_experts"),
    ("mla_deepseek", "num_experts_per_tok"),
    ("mla_deepseek", "moe_intermediate_size"),
    ("mla_deepseek", "n_shared_experts"),
    ("mla_deepseek", "first_k_dense_replace"),
    ("moe_mixtral", "num_local_experts"),
]


@pytest.mark.parametrize("value", [-5, "4096", float("inf"), float("nan"), True, [1], 1e300])
@pytest.mark.parametrize(("fixture", "field"), OPTIONAL_FIELDS, ids=[f for _, f in OPTIONAL_FIELDS])
def test_a_bad_value_of_any_field_read_is_a_clear_error_naming_it(fixture, field, value):
    """A broken config (negative, text, infinite, a list) is refused with the field's name, not
    priced with negative weights or a Python error that names nothing."""
    cfg = load_config(FIX / f"{fixture}.json")
    assert field in cfg  # the fixture has it: the value below replaces one the model reads
    cfg[field] = value
    with pytest.raises(ArchitectureError, match=field):
        parse_shape(cfg)


def test_load_config_errors(tmp_path):
    with pytest.raises(ArchitectureError, match="cannot read"):
        load_config(tmp_path / "missing")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ArchitectureError, match="not valid JSON"):
        load_config(tmp_path)


def test_an_integer_past_the_json_modules_digit_limit_is_not_valid_json(tmp_path):
    # the json module raises a plain ValueError for it, not a JSONDecodeError
    (tmp_path / "config.json").write_text('{"pad_token_id": 1' + "0" * 5000 + "}")
    with pytest.raises(ArchitectureError, match=r"not valid JSON: .*4300"):
        load_config(tmp_path)


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"])
@pytest.mark.parametrize("value", [0.5, 3.7])
def test_a_required_size_that_is_not_a_whole_number_is_named(field, value):
    """0.5 layers became 0 (γ 0), a hidden size of 0.5 a division by zero, 3.7 heads 3."""
    cfg = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 10}
    cfg["intermediate_size"] = 128
    with pytest.raises(ArchitectureError, match=field):
        parse_shape({**cfg, field: value})


def test_fewer_hidden_units_than_heads_without_head_dim_is_refused_not_a_zero_gamma():
    # head_dim = hidden_size // num_attention_heads = 0: no KV bytes at all
    cfg = {"hidden_size": 2, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 10}
    with pytest.raises(ArchitectureError, match="head_dim"):
        parse_shape({**cfg, "intermediate_size": 8})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_hidden_layers": 2**52}, "num_hidden_layers must be at most"),
        ({"hidden_size": 2**52}, "N_active at most"),
        ({"num_hidden_layers": 10**6, "hidden_size": 10**4}, "N_active at most"),
    ],
    ids=["layers", "hidden", "both"],
)
def test_a_model_past_any_built_is_refused_not_out_of_memory_or_a_vanishing_gamma(change, message):
    """2**52 layers made lists of 2**52 entries (MemoryError); 2**52 hidden units a γ of 1e-14."""
    cfg = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 10}
    cfg.update(intermediate_size=128, num_local_experts=4, num_experts_per_tok=1, decoder_sparse_step=2)
    with pytest.raises(ArchitectureError, match=message):
        parse_shape({**cfg, **change})


def test_every_step_th_layer_of_a_qwen_moe_is_sparse():
    cfg = {"hidden_size": 64, "num_hidden_layers": 7, "num_attention_heads": 4, "vocab_size": 10}
    cfg.update(intermediate_size=128, num_experts=4, num_experts_per_tok=1, decoder_sparse_step=3)
    dense = parse_shape({**cfg, "num_experts": 0})
    # attention 4·64·16·4 = 16384 per layer; dense MLP 3·64·128 = 24576; one expert 24576 + router 256
    assert dense.n_active == 7 * (16384 + 24576) + 640
    # layers 3 and 6 (of 1..7) sparse: the same active weights plus the router, 3 more experts in total
    assert parse_shape(cfg).n_active == dense.n_active + 2 * 256
    assert parse_shape(cfg).n_total == dense.n_active + 2 * (256 + 3 * 24576)


def test_more_dense_layers_than_layers_is_a_dense_model_not_negative_weights():
    """``first_k_dense_replace`` past the layer count (DeepSeek: the first k layers are dense)
    leaves no sparse layer: the same weights as k = the layer count, not fewer than none."""
    cfg = load_config(FIX / "mla_deepseek.json")
    all_dense = parse_shape({**cfg, "first_k_dense_replace": cfg["num_hidden_layers"]})
    past = parse_shape({**cfg, "first_k_dense_replace": 100})
    assert (past.n_active, past.n_total) == (all_dense.n_active, all_dense.n_total)
    assert all_dense.n_active == all_dense.n_total > 0
