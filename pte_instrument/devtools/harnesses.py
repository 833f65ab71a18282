"""The evaluation harnesses' own commands, run against a server with the plugin: ``lm_eval``
(chat completions) and ``inspect eval`` (the OpenAI-compatible provider), offline (a local task,
nothing downloaded). For the end-to-end test and the example report."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent
PROVIDER = "local"  # Inspect's name for the server: its key is read from LOCAL_API_KEY


def offline_env(home: Path, api_key: str = "unused") -> dict[str, str]:
    """The environment both harnesses run in: no hub access, caches in ``home``."""
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(home / "hf"),
        f"{PROVIDER.upper()}_API_KEY": api_key,
        "PYTHONDONTWRITEBYTECODE": "1",  # the task files are imported where they lie
    }


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout_s: float) -> None:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(
            f"{cmd[0]} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )


def run_lm_eval(
    url: str,
    model: str,
    task_dir: Path,
    task: str,
    out: Path,
    max_tokens: int,
    env: dict[str, str],
    timeout_s: float = 600,
) -> Path:
    """``lm_eval`` with ``--log_samples``, the task's data named relative to ``task_dir``."""
    _run(
        [
            str(BIN / "lm_eval"),
            "--model",
            "local-chat-completions",
            "--model_args",
            f"model={model},base_url={url}/v1/chat/completions,tokenizer_backend=none",
            "--tasks",
            task,
            "--include_path",
            str(task_dir),
            "--apply_chat_template",
            "--log_samples",
            "--output_path",
            str(out),
            "--gen_kwargs",
            f"max_gen_toks={max_tokens}",
        ],
        task_dir,
        env,
        timeout_s,
    )
    return out


def run_inspect(
    url: str,
    model: str,
    task_dir: Path,
    task_file: str,
    out: Path,
    max_tokens: int,
    env: dict[str, str],
    stop: str | None = None,
    timeout_s: float = 600,
) -> Path:
    """``inspect eval`` of ``task_file`` (named relative to ``task_dir``, as Inspect wants),
    its log written under ``out``."""
    _run(
        [
            str(BIN / "inspect"),
            "eval",
            task_file,
            "--model",
            f"openai-api/{PROVIDER}/{model}",
            "--model-base-url",
            f"{url}/v1",
            "--max-tokens",
            str(max_tokens),
            "--temperature",  # greedy, as lm-eval asks: the same answers every run
            "0",
            *(["--stop-seqs", stop] if stop else []),
            "--display",
            "none",
            "--log-dir",
            str(out),
        ],
        task_dir,
        env,
        timeout_s,
    )
    return out
