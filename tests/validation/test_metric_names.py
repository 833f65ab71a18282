"""The report looks metrics up by name to write its diagnoses and plots: every name it asks
for must be one the analysis produces, and the report must name them only through the
constants, so that renaming a metric cannot silently drop a sentence or a plot."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np

from pte_instrument.validation import analysis as A
from pte_instrument.validation import report as R
from pte_instrument.validation.calibrate import calibrate_requests, calibrate_steps

STEPS = Path(__file__).resolve().parents[1] / "fixtures" / "steps_small.jsonl"


def every_request_metric() -> set[str]:
    """The names of every request metric, with every optional input present."""
    rng = np.random.default_rng(0)
    n = 12
    fields = (*A.REQUEST_FIELDS, *A.SECONDS_FIELDS, *A.ENGINE_FIELDS)
    rows = [{k: float(rng.uniform(1, 100)) for k in fields} for _ in range(n)]
    for r in rows:
        r.update(request_id=f"r{len(r)}", finish_reason="stop", ctx=[r["prompt_tokens"]])
    t = A.request_table(rows)
    fit = calibrate_requests(t, 50, 0)
    return {m.name for m in A.request_metrics(t, gamma_calibrated=0.01, request_model=fit)}


def every_step_metric() -> set[str]:
    steps = A.usable_steps(A.load_steps(STEPS))
    fit, fit_dec = calibrate_steps(steps, False, 50, 0), calibrate_steps(steps, True, 50, 0)
    return {m.name for m in R._step_metrics(steps, fit, fit_dec)}


def test_every_name_the_report_asks_for_is_produced():
    produced = every_request_metric() | every_step_metric()
    produced |= {R.OFFLINE_PREDICTED, R.STEP_TIME_ALONE}  # the report's own, alone
    produced |= {R.MATCHED_PRIMARY, R.MATCHED_GPU, R.MATCHED_INFERENCE}  # and matched
    asked = {
        A.PRIMARY,
        A.PREDICTED,
        A.GPU_SECONDS,
        A.STEP_PTE,
        A.STEP_MODEL,
        A.OUTPUT_TOKENS,
        A.PTE_CALIBRATED,
        A.ROOFLINE_ENGINE,
        A.FITTED_REQUEST,
        *R.REQUEST_PLOT,
        *R.STEP_PLOT,
    }
    assert asked - produced == set()


def test_the_report_names_metrics_only_through_constants():
    """No string literal as the name given to ``_r(level, name)`` or to ``level.get(name)``."""
    tree = ast.parse(Path(R.__file__).read_text(encoding="utf-8"))
    literal = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id == "_r" and len(node.args) == 2:
            arg = node.args[1]
        elif isinstance(f, ast.Attribute) and f.attr == "get" and isinstance(f.value, ast.Name):
            if f.value.id not in ("lv", "mlv", "level"):
                continue
            arg = node.args[0] if node.args else None
        else:
            continue
        if isinstance(arg, (ast.Constant, ast.JoinedStr)):
            literal.append(node.lineno)
    assert literal == []
