"""The suite's own start-up changes (tests/vllm_site/sitecustomize.py) still apply to the
third-party versions installed: each is keyed to a module and a name that a new release may
move, and would then stop applying without an error."""

from __future__ import annotations

import subprocess
import sys


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
