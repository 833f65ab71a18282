"""docs/metrics.md is generated from the metric definitions: it must match them."""

from __future__ import annotations

import re
from types import ModuleType

from pte_instrument.server.exporters.catalog import families
from tests.conftest import ROOT
from tests.helpers import load_script


def load_generator() -> ModuleType:
    return load_script(ROOT / "scripts" / "gen_metrics_doc.py")


def test_committed_metrics_doc_matches_the_code():
    gen = load_generator()
    committed = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
    assert committed == gen.render(), "docs/metrics.md is stale: run python scripts/gen_metrics_doc.py"


def test_every_family_is_documented_with_its_exposed_name():
    text = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
    fams = families()
    assert fams and all(f.name.startswith("pte_") for f in fams)
    for f in fams:
        assert f"| `{f.exposed}` | {f.type} |" in text, f.exposed
        assert f.help, f"{f.name} has no help text"
    assert any(f.exposed == "pte_requests_total" for f in fams)  # counters carry _total


def test_the_header_cites_files_that_exist():
    gen = load_generator()
    cited = re.findall(r"\b(?:pte_instrument|scripts)/[\w/]+\.py\b", gen.HEADER)
    assert "pte_instrument/server/exporters/families.py" in cited
    for path in cited:
        assert (ROOT / path).is_file(), f"docs/metrics.md cites {path}, which does not exist"
