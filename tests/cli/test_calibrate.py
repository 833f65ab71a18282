"""``pte calibrate``: the four-term step-time model fitted on a step log (the fixture
tests/fixtures/steps_small.jsonl, written from known coefficients by ``fixture_text`` below) and
on CSV, its stable JSON, and bad input answered in one line with exit code 2."""

from __future__ import annotations

import csv
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pte_instrument.cli.errors import EXIT_BAD_INPUT
from pte_instrument.cost.step_time import StepTimeModel
from pte_instrument.wire import StepLogHeader, StepLogLine, encode_step_log

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "steps_small.jsonl"

# The fixture's truth: seconds per prefill token, per context token, per memory-bound step, per
# step. b/a = 0.002 = the header's γ, so γ_measured/γ_theory is exactly 1.
TRUE = {"a": 1e-4, "b": 2e-7, "w": 5e-3, "o": 2e-3}
GAMMA = 0.002
N_ACTIVE = 1e9
HOI = 989.4 / 3.35  # h100-sxm
WEIGHTS_PTE = N_ACTIVE * 2 * HOI / (2 * N_ACTIVE)  # bf16 dense: = HOI
# (prefill tokens, decode tokens, Σ context read): 20 decode-only steps, 20 with prefill.
STEPS = [(0, r, r * L) for r in (1, 2, 4, 8, 16) for L in (100, 900, 3000, 7000)] + [
    (p, d, d * 500 + c) for p in (32, 128, 512, 1024, 2048) for d, c in ((0, 0), (1, 64), (4, 700), (8, 2500))
]


def step_seconds(prefill: float, ctx: float, memory_bound: float) -> float:
    return TRUE["a"] * prefill + TRUE["b"] * ctx + TRUE["w"] * memory_bound + TRUE["o"]


def fixture_text() -> str:
    header = StepLogHeader(
        engine=0,
        gammas=[GAMMA],
        windows=[None],
        n_active=N_ACTIVE,
        n_total=N_ACTIVE,
        hoi=HOI,
        device="h100-sxm",
        weights_pte=WEIGHTS_PTE,
    )

    def step(i: int, prefill: int, decode: int, ctx: float, dt_s: float | None) -> str:
        tokens = prefill + decode
        kv = GAMMA * ctx
        return encode_step_log(
            StepLogLine(
                engine=0,
                step=i,
                t=1.8e9 + i,
                n_reqs=max(decode, 1),
                tokens=tokens,
                prefill=prefill,
                recompute=0,
                decode_tokens=decode,
                spec_tokens=0,
                ctx=[float(ctx)],
                pte=prefill + kv,
                roofline_pte=max(tokens, WEIGHTS_PTE + kv),
                weights_pte=WEIGHTS_PTE,
                hook_s=1e-6,
                dt_s=dt_s,
            )
        )

    lines = [encode_step_log(header)]
    for i, (prefill, decode, ctx) in enumerate(STEPS):
        mb = 1.0 if prefill + decode < WEIGHTS_PTE + GAMMA * ctx else 0.0
        lines.append(step(i, prefill, decode, ctx, round(step_seconds(prefill, ctx, mb), 12)))
    # the latest step, still running when the log was read: no dt_s, not fitted
    lines.append(step(len(STEPS), 0, 1, 10.0, None))
    return "".join(lines)


def pte(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pte_instrument.cli.main", "calibrate", *args], capture_output=True, text=True
    )


def test_fixture_is_what_its_generator_writes():
    assert FIXTURE.read_text() == fixture_text()


def test_hand_checked_step_times():
    # compute-bound: 512 + 4 tokens ≥ 295.3 + 0.002·2700 → 512·1e-4 + 2700·2e-7 + 2e-3 = 0.05374 s
    assert step_seconds(512, 4 * 500 + 700, 0) == pytest.approx(0.05374, rel=1e-12)
    # memory-bound decode: 8 requests at context 900: 7200·2e-7 + 5e-3 + 2e-3 = 0.00844 s
    assert step_seconds(0, 8 * 900, 1) == pytest.approx(0.00844, rel=1e-12)
    lines = [json.loads(x) for x in FIXTURE.read_text().splitlines()]
    by_step = {x["step"]: x for x in lines[1:]}
    assert by_step[30]["tokens"] == 516 and by_step[30]["dt_s"] == pytest.approx(0.05374)
    assert by_step[13]["tokens"] == 8 and by_step[13]["dt_s"] == pytest.approx(0.00844)


def test_step_log_recovers_the_coefficients():
    r = pte(str(FIXTURE), "--json", "--bootstrap", "50")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["input"] == {"format": "step-log", "rows": 41, "usable_steps": 40, "memory_bound_steps": 28}
    t = out["terms"]
    for k, v in TRUE.items():
        assert t[k]["measured"] == pytest.approx(v, rel=1e-6), k
        assert t[k]["from_prior"] is False
        lo, hi = t[k]["ci"]
        assert lo == pytest.approx(v, rel=1e-6) and hi == pytest.approx(v, rel=1e-6)  # exact data
    # γ_measured = b/a = 2e-7/1e-4 = 0.002 = the header's γ
    assert out["gamma"]["measured"] == pytest.approx(0.002, rel=1e-6)
    assert out["gamma"]["theory"] == pytest.approx(0.002)
    assert out["gamma"]["measured_over_theory"] == pytest.approx(1.0, rel=1e-6)
    assert out["calibrated"]["r2"] == pytest.approx(1.0) and out["calibrated"]["mape"] < 1e-6
    # Theory on h100-sxm at the default fractions 0.8 (FLOP/s) and 0.85 (bandwidth), 1 ms/step:
    #   a = 2·1e9 / (989.4e12·0.8) = 2.52678e-6 s/token
    #   KV bytes/token = γ·2·N/HOI = 0.002·2e9/295.343 = 13543.5; b = 13543.5/(3.35e12·0.85) = 4.75624e-9
    #   weight bytes = weights_pte·2·N/HOI = 2e9; w = 2e9/(3.35e12·0.85) = 7.02371e-4 s
    assert t["a"]["theory"] == pytest.approx(2.52678e-6, rel=1e-5)
    assert t["b"]["theory"] == pytest.approx(4.75624e-9, rel=1e-5)
    assert t["w"]["theory"] == pytest.approx(7.02371e-4, rel=1e-5)
    assert t["o"]["theory"] == pytest.approx(1e-3)
    assert out["weight_read_pte"]["theory"] == pytest.approx(HOI)
    assert out["weight_read_pte"]["measured"] == pytest.approx(TRUE["w"] / TRUE["a"], rel=1e-6)  # 50 PTE
    assert out["theory_only"]["mape"] > 0.5  # theory is far faster than these made-up times
    assert out["device"]["name"] == "h100-sxm"


def test_json_is_stable_and_sorted():
    a = pte(str(FIXTURE), "--json", "--bootstrap", "20", "--seed", "3")
    b = pte(str(FIXTURE), "--json", "--bootstrap", "20", "--seed", "3")
    assert a.returncode == 0 and a.stdout == b.stdout
    out = json.loads(a.stdout)
    assert list(out) == sorted(out)
    assert set(out) == {
        "at_host_speed",
        "bootstrap",
        "calibrated",
        "device",
        "from_prior",
        "gamma",
        "input",
        "notes",
        "saved",
        "terms",
        "theory_only",
        "weight_read_pte",
    }
    assert set(out["terms"]) == {"a", "b", "w", "o"}
    assert set(out["terms"]["a"]) == {
        "unit",
        "theory",
        "measured",
        "ci",
        "from_prior",
        "measured_over_theory",
    }


def test_gzip_table_and_save(tmp_path: Path):
    gz = tmp_path / "steps.jsonl.gz"
    gz.write_bytes(gzip.compress(FIXTURE.read_bytes()))
    saved = tmp_path / "fit.json"
    r = pte(str(gz), "--bootstrap", "0", "--save", str(saved))
    assert r.returncode == 0, r.stderr
    assert "γ = b/a" in r.stdout and "calibrated:" in r.stdout and "theory only:" in r.stdout
    m = StepTimeModel.load(saved)
    assert (m.a, m.b, m.w, m.o) == pytest.approx(tuple(TRUE.values()), rel=1e-6)


def _csv(path: Path, columns: list[str], rows: list[dict[str, float]]) -> Path:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return path


def _csv_rows() -> list[dict[str, float]]:
    rows = []
    for prefill, decode, ctx in STEPS:
        tokens = prefill + decode
        mb = 1.0 if tokens < WEIGHTS_PTE + GAMMA * ctx else 0.0
        rows.append(
            {
                "prefill_tokens": prefill,
                "ctx": ctx,
                "memory_bound": mb,
                "dt_s": step_seconds(prefill, ctx, mb),
                "tokens": tokens,
                "weights_pte": WEIGHTS_PTE,
                "pte": prefill + GAMMA * ctx,
            }
        )
    return rows


@pytest.mark.parametrize(
    "columns",
    [
        ["prefill_tokens", "ctx", "memory_bound", "dt_s"],
        ["prefill_tokens", "ctx", "dt_s", "tokens", "weights_pte", "pte"],  # memory_bound computed
    ],
)
def test_csv_recovers_the_coefficients(tmp_path: Path, columns: list[str]):
    path = _csv(tmp_path / "steps.csv", columns, _csv_rows())
    r = pte(str(path), "--json", "--bootstrap", "0")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["input"]["format"] == "csv" and out["input"]["memory_bound_steps"] == 28
    for k, v in TRUE.items():
        assert out["terms"][k]["measured"] == pytest.approx(v, rel=1e-6), k
    assert out["theory_only"] is None and out["terms"]["a"]["theory"] is None  # no --model-dir


def test_csv_steps_past_what_the_fit_can_square_are_left_out(tmp_path: Path):
    """A step of 1e308 prefill tokens, one of 1e308 context and one of 1e-320 s (subnormal):
    the relative-error fit's squares overflow on them (numpy's eigen-solve raised). They are
    not usable steps, and the others are fitted as without them."""
    rows = _csv_rows()
    rows += [{**rows[0], "prefill_tokens": 1e308}, {**rows[1], "ctx": 1e308}, {**rows[2], "dt_s": 1e-320}]
    path = _csv(tmp_path / "steps.csv", ["prefill_tokens", "ctx", "memory_bound", "dt_s"], rows)
    r = pte(str(path), "--json", "--bootstrap", "20")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["input"]["rows"], out["input"]["usable_steps"]) == (43, 40)
    for k, v in TRUE.items():
        assert out["terms"][k]["measured"] == pytest.approx(v, rel=1e-6), k


def test_step_log_counts_past_what_a_float_holds_leave_the_step_out(tmp_path: Path):
    """JSON integers have no bound: a step of 10**400 tokens (numpy refused to convert it)
    is not a usable step; the fixture's 40 are fitted."""
    lines = FIXTURE.read_text().splitlines()
    step = json.loads(lines[1])
    huge = json.dumps({**step, "step": 99}).replace(
        f'"prefill": {step["prefill"]}', '"prefill": 1' + "0" * 400
    )
    path = _write(tmp_path / "steps.jsonl", "\n".join([*lines, huge]) + "\n")
    r = pte(path, "--json", "--bootstrap", "0")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["input"]["rows"], out["input"]["usable_steps"]) == (42, 40)


def test_a_host_that_slows_down_is_followed_at_its_speed(tmp_path: Path):
    # 5 × the fixture's steps, in order; from the middle on every step takes 1.5 × as long
    rows = [dict(r) for _ in range(5) for r in _csv_rows()]
    for r in rows[len(rows) // 2 :]:
        r["dt_s"] *= 1.5
    path = _csv(tmp_path / "steps.csv", ["prefill_tokens", "ctx", "memory_bound", "dt_s"], rows)
    r = pte(str(path), "--json", "--bootstrap", "0")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    # one set of coefficients cannot be both speeds; priced at the speed of the steps before,
    # only the steps right after the change are off
    assert out["calibrated"]["mape"] > 0.15
    assert out["at_host_speed"]["mape"] < out["calibrated"]["mape"] / 3
    assert out["at_host_speed"]["final_speed"] == pytest.approx(1.5 / 1.25, rel=0.1)  # the fit sits between


def test_csv_without_memory_bound_takes_decode_only_steps(tmp_path: Path):
    # The 20 decode-only steps are taken as memory-bound, every prefill step as not; eight of the
    # fixture's prefill steps (32 or 128 tokens: T < 295.3 + 0.002·ctx) were memory-bound.
    path = _csv(tmp_path / "steps.csv", ["prefill_tokens", "ctx", "dt_s"], _csv_rows())
    r = pte(str(path), "--json", "--bootstrap", "0")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["input"]["memory_bound_steps"] == 20
    assert any("decode-only" in n for n in out["notes"])


def test_model_dir_theory_for_a_csv(tmp_path: Path):
    from tests.cost.test_architecture import FIX

    path = _csv(tmp_path / "steps.csv", ["prefill_tokens", "ctx", "memory_bound", "dt_s"], _csv_rows())
    r = pte(
        str(path),
        "--json",
        "--bootstrap",
        "0",
        "--model-dir",
        str(FIX / "llama31_8b.json"),
        "--device",
        "h200",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    # Llama-3.1-8B: KV 131,072 bytes/token; h200 at 0.85 of 4.8 TB/s → b = 131072 / 4.08e12
    assert out["terms"]["b"]["theory"] == pytest.approx(131072 / 4.08e12, rel=1e-9)
    assert out["device"]["name"] == "h200" and out["theory_only"] is not None


def test_flat_memory_bound_column_takes_the_prior(tmp_path: Path):
    rows = [r for r in _csv_rows() if r["memory_bound"] == 0.0]  # only compute-bound steps
    path = _csv(tmp_path / "steps.csv", ["prefill_tokens", "ctx", "memory_bound", "dt_s"], rows)
    r = pte(str(path), "--json", "--bootstrap", "0")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["from_prior"] == ["w"] and out["terms"]["w"]["from_prior"] is True
    assert out["terms"]["w"]["measured"] == 0.0  # no prior without theory: 0, and said
    assert any("memory_bound has no variation" in n for n in out["notes"])


BAD = {
    "missing file": (lambda d: str(d / "nope.jsonl"), "cannot read"),
    "empty file": (lambda d: _write(d / "e.jsonl", ""), "holds no steps"),
    "not a step line": (
        lambda d: _write(d / "x.jsonl", FIXTURE.read_text() + '{"engine": "x"}\n'),
        "line 43",
    ),
    "not JSON": (lambda d: _write(d / "y.jsonl", "{nope\n"), "line 1"),
    "csv without dt_s": (lambda d: _write(d / "a.csv", "prefill_tokens,ctx\n1,2\n"), "lacks column(s) dt_s"),
    "csv not a number": (
        lambda d: _write(d / "b.csv", "prefill_tokens,ctx,dt_s\n1,x,0.1\n"),
        "'x' is not a number",
    ),
    "csv bad memory_bound": (
        lambda d: _write(d / "c.csv", "prefill_tokens,ctx,memory_bound,dt_s\n" + "1,2,3,0.1\n" * 9),
        "memory_bound must be 0 or 1",
    ),
    "too few steps": (lambda d: _write(d / "f.csv", "prefill_tokens,ctx,dt_s\n1,2,0.1\n"), "at least 8"),
    "binary": (lambda d: _write(d / "g.jsonl", bytes(range(256)) * 4), "not"),
    "bad gzip": (lambda d: _write(d / "h.jsonl.gz", b"not gzip at all"), "cannot read"),
    "unknown device": (lambda d: str(FIXTURE), "unknown device"),
}


def _write(path: Path, content: str | bytes) -> str:
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_exit_2(tmp_path: Path, case: str):
    make, expected = BAD[case]
    extra = ["--device", "tpu-v9"] if case == "unknown device" else []
    r = pte(make(tmp_path), "--json", *extra)
    assert r.returncode == EXIT_BAD_INPUT, (r.stdout, r.stderr)
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pte calibrate: error: "), r.stderr
    assert expected in lines[0]
