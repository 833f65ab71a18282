"""The suite's own start-up changes (tests/vllm_site/sitecustomize.py) still apply to the
third-party versions installed: each is keyed to a module and a name that a new release may
move, and would then stop applying without an error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_a_process_the_suite_starts_imports_transformers_without_scikit_learn():
    probe = (
        "import sys, transformers.generation.candidate_generator, sklearn; "
        "print(sys.modules['transformers.utils'].is_sklearn_available())"
    )
    before = "import sys, transformers.generation.candidate_generator; print('sklearn' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", before], capture_output=True, text=True, check=True).stdout
        == "False\n"
    )
    # scikit-learn itself still imports, for what needs it
    assert (
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
        == "False\n"
    )


def test_the_serial_run_collects_only_the_files_with_tests_marked_alone():
    """``make test``'s serial run (``-m alone``) imports no other test file: collecting them
    all, vLLM imported by some, took it 8 s of a 35 s run."""
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
