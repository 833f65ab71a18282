"""The shipped Prometheus rules: the committed files are what the generator makes, promtool
accepts the rule file and passes its unit tests (every alert firing and not firing, every
recorded series' value worked out by hand), and every expression reads metrics and labels
the plugin really exports. ``tests/e2e/test_prometheus_e2e.py`` then loads the file into a
real Prometheus scraping a real server."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from deploy.generate import RULE_FILE, main, outputs
from prometheus.rules import ALERTS, GROUPS, RECORDING, Alert, Recording, rule_groups
from pte_instrument.server.exporters.catalog import families
from tests.conftest import ROOT
from tests.promql import grouping_labels, selectors, series_names

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
needs_promtool = pytest.mark.skipif(
    not Path(PROMTOOL).exists(),
    reason="no promtool binary: run scripts/install_test_deps.sh (apt-get install prometheus)",
)
UNIT_TESTS = ROOT / "prometheus" / "pte-rules.test.yml"
# Labels Prometheus attaches to every scraped series (the scrape target's).
TARGET_LABELS = {"job", "instance"}
RECORD_NAME = re.compile(r"^[a-z_]+:[a-z0-9_]+:[a-z0-9_]+$")
SIMPLE_RATE = re.compile(r"^sum by \(([^)]*)\) \(rate\(([a-z0-9_]+)_total\[5m\]\)\)$")
DURATION = re.compile(r"^[0-9]+[smhd]$")


def exported_labels() -> dict[str, set[str]]:
    """Every sample name the plugin exposes, with its labels (and ``le`` on buckets)."""
    return {
        s: set(f.labels) | ({"le"} if s.endswith("_bucket") else set()) for f in families() for s in f.samples
    }


def level_labels(record: str) -> set[str]:
    """The labels a recorded series keeps, read from its name's level (``model_name_engine``:
    model_name and engine; ``instance`` includes its ``job``)."""
    vocabulary = sorted(
        {label for f in families() for label in f.labels} | TARGET_LABELS, key=len, reverse=True
    )
    level, out = record.split(":")[0], set()
    while level:
        label = next((v for v in vocabulary if level == v or level.startswith(v + "_")), None)
        assert label is not None, f"{record}: level names an unknown label at {level!r}"
        out.add(label)
        level = level[len(label) + 1 :]
    return out | ({"job"} if "instance" in out else set())


def test_committed_files_are_what_the_generator_makes():
    for path, render in outputs().items():
        assert path.read_text(encoding="utf-8") == render(), (
            f"{path.relative_to(ROOT)} is stale: run python -m deploy.generate"
        )
        assert render() == render()  # deterministic within a run too
    assert main(["--check"]) == 0


def test_the_rule_file_holds_the_groups():
    text = RULE_FILE.read_text(encoding="utf-8")
    assert yaml.safe_load(text) == {"groups": rule_groups()}
    assert [g["name"] for g in rule_groups()] == ["pte-instrument.rules", "pte-instrument.alerts"]
    assert all(isinstance(r, Recording) for r in GROUPS[0].rules)
    assert all(isinstance(r, Alert) for r in GROUPS[1].rules)


@needs_promtool
def test_promtool_accepts_the_rule_file():
    proc = subprocess.run(
        [PROMTOOL, "check", "rules", str(RULE_FILE)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(RECORDING) + len(ALERTS)} rules found" in proc.stdout


@needs_promtool
def test_promtool_unit_tests_pass():
    proc = subprocess.run(
        [PROMTOOL, "test", "rules", UNIT_TESTS.name],
        cwd=UNIT_TESTS.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_every_alert_has_a_unit_test_firing_and_one_not_firing():
    tests = yaml.safe_load(UNIT_TESTS.read_text(encoding="utf-8"))["tests"]
    checks = [c for t in tests for c in t.get("alert_rule_test", [])]
    for alert in ALERTS:
        mine = [c for c in checks if c["alertname"] == alert.alert]
        assert any(c["exp_alerts"] for c in mine), f"{alert.alert}: no unit test where it fires"
        assert any(not c["exp_alerts"] for c in mine), f"{alert.alert}: no unit test where it does not fire"
        for c in mine:  # the expected alerts carry the rule's own labels
            assert all(a["exp_labels"]["severity"] == alert.severity for a in c["exp_alerts"]), alert.alert
    assert {c["alertname"] for c in checks} == {a.alert for a in ALERTS}


def test_every_recorded_series_has_its_value_checked_by_a_unit_test():
    tests = yaml.safe_load(UNIT_TESTS.read_text(encoding="utf-8"))["tests"]
    checked = {series_names(c["expr"]).pop() for t in tests for c in t.get("promql_expr_test", [])}
    assert checked == {r.record for r in RECORDING}


def test_every_expression_reads_exported_metrics_and_labels():
    exported = exported_labels()
    recorded: dict[str, set[str]] = {}
    for group in GROUPS:
        for rule in group.rules:
            name = rule.record if isinstance(rule, Recording) else rule.alert
            read = series_names(rule.expr)
            assert read, f"{name}: reads no series in {rule.expr!r}"
            # A rule may read a series recorded earlier in its group (evaluated in order) or in
            # the recording group before the alerts.
            unknown = read - exported.keys() - recorded.keys()
            assert not unknown, f"{name}: reads {sorted(unknown)}, which nothing exports or records before it"
            labels = set().union(*(exported.get(s) or recorded.get(s) or set() for s in read)) | TARGET_LABELS
            assert grouping_labels(rule.expr) <= labels, f"{name}: groups by labels its series lack"
            for series, matched in selectors(rule.expr):
                assert matched <= (exported.get(series) or recorded.get(series, set())) | TARGET_LABELS, name
            if isinstance(rule, Recording):
                recorded[rule.record] = level_labels(rule.record)


def test_recorded_series_are_named_level_metric_operations():
    for rule in RECORDING:
        assert RECORD_NAME.match(rule.record), rule.record
        _, metric, operations = rule.record.split(":")
        assert metric.startswith("pte_") and not metric.endswith("_total"), rule.record
        simple = SIMPLE_RATE.match(rule.expr)
        if simple is not None:  # sum by (level) (rate(metric_total[5m]))
            assert level_labels(rule.record) == {label.strip() for label in simple[1].split(",")}, rule.record
            assert (metric, operations) == (simple[2], "rate5m"), rule.record
        if operations.startswith("ratio"):  # a ratio of two series: <numerator>_per_<denominator>
            assert "_per_" in metric, rule.record
    assert len({r.record for r in RECORDING}) == len(RECORDING)


def test_empty_on_test_server_names_a_metric_that_is_empty_there():
    from tests.test_grafana import EMPTY_ON_TEST_SERVER

    flagged = [r for r in RECORDING if r.empty_on_test_server is not None]
    assert [r.record for r in flagged] == ["model_name:pte_cost_usd_per_hour:rate5m"]
    for r in flagged:
        assert series_names(r.expr) & EMPTY_ON_TEST_SERVER[r.empty_on_test_server], r.record


def test_alerts_carry_for_severity_and_annotations():
    for a in ALERTS:
        assert re.match(r"^Pte[A-Za-z]+$", a.alert), a.alert
        assert DURATION.match(a.for_) and a.for_ != "0s", a.alert
        assert a.severity in ("critical", "warning", "info"), a.alert
        assert a.summary and a.description.endswith("."), a.alert
    assert len({a.alert for a in ALERTS}) == len(ALERTS)


def test_the_deployment_doc_explains_every_alert_and_the_generator():
    doc = (ROOT / "docs" / "deployment.md").read_text(encoding="utf-8")
    for a in ALERTS:
        assert f"`{a.alert}`" in doc, f"docs/deployment.md does not explain {a.alert}"
    for r in RECORDING:
        assert f"`{r.record}`" in doc, f"docs/deployment.md does not list {r.record}"
    assert "python -m deploy.generate" in doc
    for path in outputs():
        assert str(path.relative_to(ROOT)) in doc, path
