"""`pte efficiency` and `pte report` through their argparse hooks: stable JSON, markdown,
plots, and one-line errors with exit code 2 for bad input."""

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from pte_instrument.cli.efficiency import (
    add_efficiency_parser,
    add_report_parser,
    cost_model_for_gamma,
)

FIXTURES = Path(__file__).parents[1] / "fixtures"


def run(argv, capsys):
    parser = argparse.ArgumentParser(prog="pte")
    sub = parser.add_subparsers(dest="command", required=True)
    add_efficiency_parser(sub)
    add_report_parser(sub)
    args = parser.parse_args(argv)
    code = args.func(args)
    out, err = capsys.readouterr()
    return code, out, err


def records_file(tmp_path):
    """The hand case of test_efficiency_stats (A vs reference B), plus one bad row."""
    S = {"A": [1, 0, 1, 0], "B": [1, 1, 1, 0]}
    T = {"A": [100, 200, 300, 400], "B": [50, 150, 200, 100]}
    C = {"A": [0, 0, 0, 1], "B": [0, 0, 0, 0]}
    W = [10, 40, 20, 80]
    rows = [
        {
            "model": m,
            "benchmark": "bench",
            "instance_id": f"i{k}",
            "correct": bool(S[m][k]),
            "output_tokens": T[m][k],
            "finish_reason": "length" if C[m][k] else "stop",
            "workload": W[k],
            "pte_served": 10.0 * T[m][k],
        }
        for m in "AB"
        for k in range(4)
    ]
    rows.append(
        {
            "model": "A",
            "benchmark": "bench",
            "instance_id": "i9",
            "correct": True,
            "output_tokens": 5,
            "finish_reason": "length",
        }
    )  # line 9: correct but truncated
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_efficiency_json_is_stable_and_correct(tmp_path, capsys):
    path = records_file(tmp_path)
    argv = ["efficiency", str(path), "--reference", "B", "--bootstrap", "50", "--json"]
    code, out, err = run(argv, capsys)
    assert code == 0
    assert "records.jsonl:9" in err and "correct but truncated" in err  # named, not silent
    data = json.loads(out)
    assert data["schema"] == "pte-efficiency/1"
    assert data["input"]["rows_dropped"] == 1
    assert data["input"]["problems"][0]["where"].endswith(":9")
    b = data["benchmarks"]["bench"]
    qa = b["views"]["outcome"]["models"]["A"]["quantities"]
    assert qa["e0"]["value"] == pytest.approx(2.0)  # 1000·2/1000
    assert qa["pte_per_correct"]["value"] == pytest.approx(5000.0)  # 10·1000/2
    dec = b["views"]["workload"]["models"]["A"]["decomposition"]
    assert dec["dlog_e0"]["value"] == pytest.approx(-math.log(3))
    assert dec["terms"]["overhead"]["value"] == pytest.approx(-math.log(1.75))
    assert b["signatures"]["B"]["label"] == "reference"
    assert out == json.dumps(data, indent=2, sort_keys=True) + "\n"  # sorted keys
    code2, out2, _ = run(argv, capsys)
    assert code2 == 0 and out2 == out  # seeded: byte-identical


def test_efficiency_markdown_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = records_file(tmp_path)
    plots = tmp_path / "plots"
    code, out, _ = run(
        [
            "efficiency",
            str(path),
            "--reference",
            "B",
            "--bootstrap",
            "20",
            "--workload",
            "solver",
            "--splits",
            "5",
            "--plots",
            str(plots),
        ],
        capsys,
    )
    assert code == 0
    assert "# Reasoning-efficiency report" in out
    assert "not FLOPs or latency" in out and "not semantic validity" in out
    assert "| model | shared n | Δlog E0 |" in out
    assert "Solver-derived workload" in out and "leave-self-out" in out
    pngs = sorted(p.name for p in plots.iterdir())
    assert pngs == ["bench-accuracy-e0.png", "bench-dlog.png", "bench-vo-kappa.png"]
    assert all((plots / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--reference", "nobody"], "reference model 'nobody' has no records"),
        (["--reference", "B", "--benchmark", "other"], "benchmark 'other' not in the records"),
        (["--reference", "B", "--pool", "A,B"], "--pool applies only with --workload solver"),
        (["--reference", "B", "--workload", "solver", "--pool", "A,Z"], "pool model(s) Z"),
        (["--reference", "B", "--strict"], "1 bad record(s); first:"),
    ],
)
def test_efficiency_bad_input_exit_2(tmp_path, capsys, extra, message):
    code, out, err = run(["efficiency", str(records_file(tmp_path)), *extra], capsys)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert lines[-1].startswith("pte efficiency: error:") and message in lines[-1]
    assert "Traceback" not in err


def test_efficiency_native_without_workload_and_missing_file(tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    path.write_text(
        json.dumps(
            {
                "model": "A",
                "benchmark": "b",
                "instance_id": 1,
                "correct": True,
                "output_tokens": 3,
                "truncated": False,
            }
        )
        + "\n"
    )
    code, _, err = run(["efficiency", str(path), "--reference", "A", "--workload", "native"], capsys)
    assert code == 2 and "has no workload field" in err
    code, _, err = run(["efficiency", str(tmp_path / "nope.csv"), "--reference", "A"], capsys)
    assert code == 2 and "no such file" in err


def test_efficiency_subprocess_has_no_traceback(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    code = (
        "import sys; from pte_instrument.cli.efficiency import main; "
        f"sys.exit(main(['efficiency', {str(bad)!r}, '--reference', 'A']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"pte efficiency: error: no valid evaluation records in {bad}; first problem: "
        f"{bad}:1: invalid JSON (Expecting property name enclosed in double quotes)"
    ]


# ----------------------------------------------------------------------------- report


def trajectories_file(tmp_path):
    py = {"type": "code", "name": "python", "code": "print(1)", "output": "1"}
    rows = [
        {
            "model": "m",
            "task": "t",
            "id": "1",
            "correct": True,
            "turns": [
                {"prompt_tokens": 100, "output_tokens": 10},
                {"prompt_tokens": 150, "cached_tokens": 100, "output_tokens": 20, "tool_calls": [py]},
            ],
        },
        {
            "model": "m",
            "task": "t",
            "id": "2",
            "correct": False,
            "turns": [{"prompt_tokens": 300, "output_tokens": 0, "parse_errors": 1}],
        },
    ]
    path = tmp_path / "traj.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_cost_model_for_gamma_is_exact():
    assert cost_model_for_gamma(0.01).gamma == pytest.approx(0.01, rel=1e-15)


def test_report_json_and_markdown(tmp_path, capsys):
    path = trajectories_file(tmp_path)
    code, out, _ = run(["report", str(path), "--gamma", "0.01", "--json", "--bootstrap", "20"], capsys)
    assert code == 0
    data = json.loads(out)
    g = data["groups"][0]
    # trajectory 1 served = 192.35 (see test_pricing_by_hand); trajectory 2 = 300
    assert g["avg_pte"]["served"] == pytest.approx((192.35 + 300) / 2)
    assert g["patterns"]["tool_format_collapse"]["count"] == 1
    assert g["patterns"]["tool_format_collapse"]["multiplier"] == pytest.approx(300 / 192.35)
    assert data["cost_model"]["gamma"] == pytest.approx(0.01)
    code, out, _ = run(["report", str(path), "--gamma", "0.01"], capsys)
    assert code == 0 and "| model | task | n | accuracy | avg uncached tokens |" in out
    assert "tool format collapse" in out


def test_report_with_model_config_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    code, out, err = run(
        [
            "report",
            str(trajectories_file(tmp_path)),
            "--model-dir",
            str(FIXTURES / "llama31_8b.json"),
            "--device",
            "h100-sxm",
            "--json",
            "--plots",
            str(tmp_path / "p"),
        ],
        capsys,
    )
    assert code == 0, err
    assert json.loads(out)["cost_model"]["device"] == "h100-sxm"
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == [
        "pte-correct-incorrect.png",
        "pte-per-step.png",
    ]


def test_report_bad_input_exit_2(tmp_path, capsys):
    path = trajectories_file(tmp_path)
    code, _, err = run(["report", str(path), "--model-dir", str(tmp_path)], capsys)
    assert code == 2 and err.startswith("pte report: error: cannot read model config")
    code, _, err = run(
        ["report", str(path), "--model-dir", str(FIXTURES / "llama31_8b.json"), "--device", "abacus"], capsys
    )
    assert code == 2 and "unknown device 'abacus'" in err
    code, _, err = run(["report", str(tmp_path / "none.jsonl"), "--gamma", "1"], capsys)
    assert code == 2 and "cannot read" in err
    with pytest.raises(SystemExit) as e:  # neither --gamma nor --model-dir: argparse usage error
        run(["report", str(path)], capsys)
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        run(["report", str(path), "--gamma", "-1"], capsys)
