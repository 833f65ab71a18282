"""docs/configuration.md names every environment variable the plugin reads."""

from __future__ import annotations

import re

from tests.conftest import ROOT

PACKAGE = ROOT / "pte_instrument"


def env_vars_in_code() -> set[str]:
    """``PTE_*`` and ``OTEL_*`` names quoted in the package: what it reads from the environment."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        names |= set(re.findall(r"[\"']((?:PTE|OTEL)_[A-Z0-9_]+)[\"']", path.read_text(encoding="utf-8")))
    return names


def test_every_env_var_is_documented():
    doc = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    names = env_vars_in_code()
    assert "PTE_ENABLED" in names and "PTE_SESSION_IDLE_TTL_S" in names
    missing = sorted(n for n in names if f"`{n}`" not in doc)
    assert not missing, f"docs/configuration.md lacks {missing}"


def test_the_settings_know_every_pte_variable_the_code_reads():
    from pte_instrument.settings import NAMES

    assert {n for n in env_vars_in_code() if n.startswith("PTE_")} == NAMES
