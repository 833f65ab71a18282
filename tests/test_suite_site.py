"""The suite's own start-up changes (tests/vllm_site/sitecustomize.py) still apply to the
third-party versions installed: each is keyed to a module and a name that a new release may
move, and would then stop applying without an error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_a_process_the_suite_starts_imports_transformers_without_scikit_learn():
    def output(code: str) -> str:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout

    assert (
        output("import sys, transformers.generation.candidate_generator; print('sklearn' in sys.modules)")
        == "False\n"
    )
    # scikit-learn itself still imports, for what needs it; transformers still does without it
    available = "import sklearn, transformers.utils as u; print(u.is_sklearn_available())"
    assert output(available) == "False\n"


def test_the_serial_run_collects_only_the_files_with_tests_marked_alone():
    """``make test``'s serial run (``-m alone``) imports no other test file: collecting them
    all imports vLLM, about 8 s of the run."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "alone", "--collect-only", "-q", "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    files = {line.split("::")[0] for line in run.stdout.splitlines() if "::" in line}
    assert files == {"tests/e2e/test_pricing_e2e.py"}
    assert "deselected" not in run.stdout, run.stdout[-500:]


def test_a_server_that_runs_the_model_in_its_engine_process_forks_it():
    """vLLM's CPU platform asks for ``spawn``; with the model in the engine process the suite's
    servers fork it instead, and with a worker process they keep vLLM's choice."""
    model = Path(__file__).parent.parent / "models" / "tiny"
    code = f"""
import os
from vllm.config import ModelConfig, VllmConfig

def method(multiprocessing):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = multiprocessing
    os.environ.pop("VLLM_WORKER_MULTIPROC_METHOD", None)
    VllmConfig(model_config=ModelConfig(model={str(model)!r}, dtype="float32", skip_tokenizer_init=True))
    return os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")

print(method("0"), method("1"))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["fork", "spawn"], run.stdout
