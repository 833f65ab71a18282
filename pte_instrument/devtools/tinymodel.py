"""Build small Llama-architecture models locally: random weights, a locally trained
byte-level BPE tokenizer and a chat template. No download; deterministic from a seed.

The demo, the tests and the bench serve these with a real vLLM engine.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

_WORDS = (
    "agent tool call result search python code compute value answer reason step plan "
    "check list file read write query table row column sum mean error retry output "
    "input context cache token prefix decode prefill model server request session "
    "turn pause the a of to and in is that for it with as on be by this are from or "
    "an at which "
).split()

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|start_header|>{{ m['role'] }}<|end_header|>\n{{ m['content'] }}<|eot|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|start_header|>assistant<|end_header|>\n"
    "{% endif %}"
)
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|eot|>", "<|start_header|>", "<|end_header|>", "<|pad|>"]


@dataclass(frozen=True)
class ModelPreset:
    """Shapes of a generated model; head_dim 64 because vLLM's CPU attention needs it."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int


DTYPE = "float32"  # as the test and demo servers serve it (serving.CPU_DEFAULT_ARGS)

PRESETS: dict[str, ModelPreset] = {
    "tiny": ModelPreset(128, 2, 2, 1, 256, 1024, 4096),
    # ~100M parameters with real Llama-style proportions, for the latency bench.
    "small": ModelPreset(768, 12, 12, 4, 2048, 8192, 8192),
}


def _corpus(seed: int, n_lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 30))) for _ in range(n_lines)]


def build_tokenizer(out_dir: Path, vocab_size: int, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot|>",
        pad_token="<|pad|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def build_model(out_dir: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Write a loadable Hugging Face model directory; skip if it already exists."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    shapes = PRESETS[preset]
    stamp = out / "pte_model.json"
    wanted = {"preset": preset, "seed": seed, "dtype": DTYPE, **asdict(shapes)}
    if stamp.exists() and json.loads(stamp.read_text()) == wanted:
        return out
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, shapes.vocab_size, seed)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(out))
    config = LlamaConfig(
        hidden_size=shapes.hidden_size,
        num_hidden_layers=shapes.num_hidden_layers,
        num_attention_heads=shapes.num_attention_heads,
        num_key_value_heads=shapes.num_key_value_heads,
        head_dim=shapes.hidden_size // shapes.num_attention_heads,
        intermediate_size=shapes.intermediate_size,
        vocab_size=max(vocab, shapes.vocab_size),
        max_position_embeddings=shapes.max_position_embeddings,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=4,
        tie_word_embeddings=False,
        torch_dtype=DTYPE,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, DTYPE))
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps(wanted, indent=1))
    return out


LORA_TARGETS = ("q_proj", "v_proj")


def build_lora_adapter(out_dir: str | Path, base_dir: str | Path, rank: int = 8, seed: int = 0) -> Path:
    """Write a LoRA adapter (PEFT's file layout: ``adapter_config.json`` and
    ``adapter_model.safetensors``) for a model built by :func:`build_model`: random low-rank
    updates of the attention's query and value projections. Deterministic from ``seed``."""
    import torch
    from safetensors.torch import save_file

    out = Path(out_dir)
    config = json.loads((Path(base_dir) / "config.json").read_text())
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    outputs = {
        "q_proj": config["num_attention_heads"] * head_dim,
        "v_proj": config["num_key_value_heads"] * head_dim,
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for target in LORA_TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = (
                torch.randn(outputs[target], rank, generator=generator) * 0.02
            )
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_dir),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(LORA_TARGETS),
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=1))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(build_model(args.out_dir, args.preset, args.seed))


if __name__ == "__main__":
    main()
