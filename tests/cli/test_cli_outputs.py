"""What the ``pte`` subcommands make of the values that name their inputs and outputs, and
how they write their output files: an empty value or ``-`` where a file must be named is a
usage error naming the option; an output folder is written all or none; ``--save`` through a
link writes the link's target; an input CSV with a field in two columns is refused."""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from pte_instrument.cli.errors import EXIT_BAD_INPUT
from pte_instrument.cli.main import main
from pte_instrument.cost.step_time import StepTimeModel
from tests.cli.test_bad_options import (
    FIXTURE,
    one_line_error,
    records,
    request_log,
    trajectories,
    usage_error,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PTE = [sys.executable, "-m", "pte_instrument.cli.main"]


def listing(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (hidden ones too) with its bytes; None for a folder."""
    return {
        str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))
    }


def small_files(limit: int):  # writes past `limit` bytes fail (EFBIG; Python ignores SIGXFSZ)
    def set_limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return set_limit


# --------------------------------------------------------------------------- empty values


@pytest.mark.parametrize(
    "case",
    [
        ("efficiency", "--plots"),
        ("efficiency", "--request-log"),
        ("report", "--plots"),
        ("report", "--model-dir"),
        ("validate", "--out"),
        ("validate", "step_log"),
        ("calibrate", "--model-dir"),
        ("gamma", "model"),
    ],
)
def test_an_empty_path_is_a_usage_error_naming_the_option_and_nothing_is_written(
    tmp_path, monkeypatch, capsys, case
):
    command, option = case
    inputs = tmp_path / "in"
    inputs.mkdir()
    log = str(request_log(inputs))
    argv = {
        "efficiency": ["efficiency", str(records(inputs)), "--reference", "a", "--bootstrap", "0"],
        "report": ["report", str(trajectories(inputs)), "--bootstrap", "0"]
        + ([] if option == "--model-dir" else ["--gamma", "0.1"]),
        "validate": ["validate", log, "--no-plots", "--bootstrap", "10"]
        + ([] if option == "--out" else ["--out", str(tmp_path / "out")]),
        "calibrate": ["calibrate", str(FIXTURE), "--bootstrap", "0"],
        "gamma": ["gamma"],
    }[command]
    if option == "step_log":
        argv.insert(2, "")
    elif option == "model":
        argv.append("")
    else:
        argv += [option, ""]
    work = tmp_path / "cwd"  # an empty path read as "." would write here
    work.mkdir()
    monkeypatch.chdir(work)
    err = usage_error(argv, capsys)
    assert f"{option}: an empty path" in err, err
    assert listing(work) == {} and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["calibrate", str(FIXTURE), "--bootstrap", "0", "--device", ""],
        ["report", "TRAJ", "--gamma", "0.1", "--device", ""],
        ["efficiency", "RECORDS", "--labels", ""],
    ],
    ids=["calibrate --device", "report --device", "efficiency --labels"],
)
def test_an_empty_value_is_a_usage_error_naming_the_option(tmp_path, capsys, argv):
    argv = [
        str(trajectories(tmp_path)) if a == "TRAJ" else str(records(tmp_path)) if a == "RECORDS" else a
        for a in argv
    ]
    err = usage_error(argv, capsys)
    assert f"{argv[-2]}: an empty" in err, err


@pytest.mark.parametrize("pool", [",", "a,,b", "a,", " "])
def test_a_pool_with_an_empty_name_is_a_usage_error_naming_the_option(tmp_path, capsys, pool):
    argv = ["efficiency", str(records(tmp_path)), "--reference", "a", "--workload", "solver"]
    err = usage_error([*argv, "--bootstrap", "0", "--splits", "0", "--pool", pool], capsys)
    assert "--pool: an empty name" in err, err


def test_a_pool_of_names_is_read_stripped(tmp_path, capsys):
    argv = ["efficiency", str(records(tmp_path)), "--reference", "a", "--workload", "solver"]
    assert main([*argv, "--bootstrap", "0", "--splits", "0", "--pool", " a , b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["pool"] == ["a", "b"]


# --------------------------------------------------------------------------- options that do nothing


def test_calibrate_kv_cache_dtype_without_model_dir_is_a_usage_error(capsys):
    err = one_line_error(["calibrate", str(FIXTURE), "--bootstrap", "0", "--kv-cache-dtype", "fp8"], capsys)
    assert "--kv-cache-dtype" in err and "--model-dir" in err


def test_devices_measure_device_without_measure_is_a_usage_error(capsys):
    err = one_line_error(["devices", "--measure-device", "cpu"], capsys)
    assert "--measure-device" in err and "--measure" in err


# --------------------------------------------------------------------------- "-" as an output


@pytest.mark.parametrize("command", ["calibrate --save", "validate --out", "report --plots"])
def test_dash_as_an_output_is_a_usage_error_and_writes_no_file_named_dash(
    tmp_path, monkeypatch, capsys, command
):
    argv = {
        "calibrate --save": ["calibrate", str(FIXTURE), "--bootstrap", "0", "--save", "-"],
        "validate --out": [
            "validate",
            str(request_log(tmp_path)),
            "--no-plots",
            "--bootstrap",
            "10",
            "--out",
            "-",
        ],
        "report --plots": ["report", str(trajectories(tmp_path)), "--gamma", "0.1", "--plots", "-"],
    }[command]
    monkeypatch.chdir(tmp_path)
    err = usage_error(argv, capsys)
    assert command.split()[1] in err and "standard output" in err, err
    assert not (tmp_path / "-").exists()


# --------------------------------------------------------------------------- output folders


def validate_argv(log: Path, out: Path, *more: str) -> list[str]:
    return ["validate", str(log), "--out", str(out), "--bootstrap", "10", *more]


def test_validate_writes_its_report_and_plots_and_leaves_no_staging_folder(tmp_path, capsys):
    log, out = request_log(tmp_path), tmp_path / "deep" / "out"
    assert main([*validate_argv(log, out), "--json"]) == 0
    files = json.loads(capsys.readouterr().out)["files"]
    names = sorted(Path(f).name for f in files)
    assert sorted(listing(out)) == names
    assert {"report.json", "report.md"} < set(names) and any(n.endswith(".png") for n in names)
    assert all(Path(f).parent == out for f in files)


def test_validate_with_a_folder_where_a_plot_must_go_leaves_the_previous_report_whole(tmp_path, capsys):
    log, out = request_log(tmp_path), tmp_path / "out"
    assert main(validate_argv(log, out, "--seed", "0")) == 0
    capsys.readouterr()
    # report.json is written first, report.md last: a plot between them cannot be written
    png = sorted(out.glob("*.png"))[-1]
    png.unlink()
    png.mkdir()
    before = listing(out)
    err = one_line_error(validate_argv(log, out, "--seed", "1"), capsys)
    assert str(png) in err, err
    assert listing(out) == before


@pytest.mark.parametrize("limit", [512, 8192])
def test_validate_on_a_full_disk_leaves_the_previous_report_whole(tmp_path, limit):
    log, out = request_log(tmp_path), tmp_path / "out"
    argv = [*PTE, *validate_argv(log, out, "--no-plots")]
    subprocess.run([*argv, "--seed", "0"], check=True, capture_output=True, timeout=300)
    before = listing(out)
    r = subprocess.run(
        [*argv, "--seed", "1"], capture_output=True, text=True, timeout=300, preexec_fn=small_files(limit)
    )
    assert r.returncode == EXIT_BAD_INPUT, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pte validate: error: cannot write the report"), lines
    assert listing(out) == before


def test_validate_into_a_new_folder_on_a_full_disk_leaves_no_folder(tmp_path):
    log, out = request_log(tmp_path), tmp_path / "new" / "out"
    r = subprocess.run(
        [*PTE, *validate_argv(log, out, "--no-plots")],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=small_files(512),
    )
    assert r.returncode == EXIT_BAD_INPUT, r.stderr
    assert not (tmp_path / "new").exists()


def test_validate_refuses_to_write_a_plot_over_a_log_it_reads(tmp_path, capsys):
    log, out = request_log(tmp_path), tmp_path / "out"
    assert main(validate_argv(log, out)) == 0
    capsys.readouterr()
    png = sorted(out.glob("*.png"))[0]
    shutil.copyfile(log, png)  # the log, kept where a plot goes
    before = listing(out)
    err = one_line_error(validate_argv(png, out), capsys)
    assert str(png) in err
    assert listing(out) == before


def second_records(tmp_path: Path) -> Path:
    """records() with other lengths: other plots."""
    path = records(tmp_path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
        r["output_tokens"] *= 3
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return other


def test_efficiency_plots_failing_half_way_leave_the_previous_plots_whole(tmp_path, capsys):
    plots = tmp_path / "plots"
    argv = ["efficiency", "--reference", "a", "--bootstrap", "0", "--plots", str(plots)]
    assert main([*argv, str(records(tmp_path))]) == 0
    capsys.readouterr()
    # the accuracy plot is written first, then the Δlog bars
    dlog = plots / "x-dlog.png"
    dlog.unlink()
    dlog.mkdir()
    before = listing(plots)
    err = one_line_error([*argv, str(second_records(tmp_path))], capsys)
    assert str(dlog) in err, err
    assert listing(plots) == before


def test_report_plots_on_a_full_disk_leave_no_part_of_a_plot(tmp_path):
    plots = tmp_path / "plots"
    plots.mkdir()
    r = subprocess.run(
        [
            *PTE,
            "report",
            str(trajectories(tmp_path)),
            "--gamma",
            "0.1",
            "--bootstrap",
            "0",
            "--plots",
            str(plots),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=small_files(4096),
    )
    assert r.returncode == EXIT_BAD_INPUT, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pte report: error: cannot write the plots"), lines
    assert listing(plots) == {}


def test_plots_into_a_file_are_refused_naming_the_option_before_any_work(tmp_path, capsys):
    traj = trajectories(tmp_path)
    before = traj.read_bytes()
    err = one_line_error(["report", str(traj), "--gamma", "0.1", "--plots", str(traj)], capsys)
    assert "--plots" in err and str(traj) in err
    assert traj.read_bytes() == before


# --------------------------------------------------------------------------- calibrate --save


def saved_model(path: Path) -> None:
    subprocess.run(
        [*PTE, "calibrate", str(FIXTURE), "--bootstrap", "0", "--save", str(path)],
        check=True,
        capture_output=True,
        timeout=120,
    )


def test_calibrate_save_through_a_link_writes_the_file_it_points_to(tmp_path, capsys):
    target = tmp_path / "models" / "fit.json"
    target.parent.mkdir()
    target.write_text("an earlier model\n")
    link = tmp_path / "current.json"
    link.symlink_to(target)
    assert main(["calibrate", str(FIXTURE), "--bootstrap", "0", "--save", str(link)]) == 0
    assert link.is_symlink() and link.resolve() == target
    StepTimeModel.load(target)
    assert sorted(p.name for p in target.parent.iterdir()) == ["fit.json"]


def test_calibrate_save_through_a_dangling_link_makes_its_target(tmp_path):
    link = tmp_path / "current.json"
    link.symlink_to(tmp_path / "fit.json")
    assert main(["calibrate", str(FIXTURE), "--bootstrap", "0", "--save", str(link)]) == 0
    assert link.is_symlink()
    StepTimeModel.load(tmp_path / "fit.json")


def test_calibrate_save_through_a_link_to_the_step_log_is_refused(tmp_path, capsys):
    steps = tmp_path / "steps.jsonl"
    steps.write_bytes(FIXTURE.read_bytes())
    link = tmp_path / "fit.json"
    link.symlink_to(steps)
    err = one_line_error(["calibrate", str(steps), "--bootstrap", "0", "--save", str(link)], capsys)
    assert "step log" in err
    assert link.is_symlink() and steps.read_bytes() == FIXTURE.read_bytes()


def test_calibrate_refuses_to_save_over_the_model_config_it_reads(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    config = model / "config.json"
    shutil.copyfile(FIXTURES / "llama31_8b.json", config)
    before = config.read_bytes()
    argv = ["calibrate", str(FIXTURE), "--bootstrap", "0", "--model-dir", str(model), "--save", str(config)]
    err = one_line_error(argv, capsys)
    assert "config" in err and str(config) in err
    assert config.read_bytes() == before


# --------------------------------------------------------------------------- a column twice


def test_calibrate_refuses_a_csv_with_a_column_twice(tmp_path, capsys):
    rows = [f"{p},{c},{1e-3 + 1e-4 * p + 1e-7 * c},9" for p in (0, 64) for c in (10, 99, 999, 5000)]
    path = tmp_path / "steps.csv"
    path.write_text("prefill_tokens,ctx,dt_s,dt_s\n" + "\n".join(rows) + "\n")
    err = one_line_error(["calibrate", str(path), "--bootstrap", "0"], capsys)
    assert "dt_s" in err and "2 times" in err, err


def test_efficiency_refuses_a_records_csv_with_a_column_twice(tmp_path, capsys):
    header = "model,benchmark,instance_id,correct,output_tokens,finish_reason,output_tokens"
    rows = [f"{m},x,i{i},{i % 2 == 0},{10 + i},stop,{99 + i}" for m in "ab" for i in range(6)]
    path = tmp_path / "records.csv"
    path.write_text(header + "\n" + "\n".join(rows) + "\n")
    err = one_line_error(["efficiency", str(path), "--reference", "a", "--bootstrap", "0"], capsys)
    assert "output_tokens" in err and "2 times" in err, err


def test_efficiency_reads_a_records_csv_with_an_unknown_column_twice(tmp_path, capsys):
    header = "model,benchmark,instance_id,correct,output_tokens,finish_reason,note,note"
    rows = [f"{m},x,i{i},{i % 2 == 0},{10 + i},stop,n,n" for m in "ab" for i in range(6)]
    path = tmp_path / "records.csv"
    path.write_text(header + "\n" + "\n".join(rows) + "\n")
    assert main(["efficiency", str(path), "--reference", "a", "--bootstrap", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["input"]["rows_used"] == 12


# --------------------------------------------------------------------------- standard output


def pte_argv(command: str, tmp_path: Path) -> list[str]:
    return {
        "gamma": ["gamma", str(FIXTURES / "llama31_8b.json"), "--json"],
        "devices": ["devices"],
        "tenant-hash": ["tenant-hash", "sk-test"],
        "calibrate": ["calibrate", str(FIXTURE), "--bootstrap", "0", "--json"],
        "validate": validate_argv(request_log(tmp_path), tmp_path / "out", "--no-plots", "--json"),
        "efficiency": ["efficiency", str(records(tmp_path)), "--reference", "a", "--bootstrap", "0"],
        "report": ["report", str(trajectories(tmp_path)), "--gamma", "0.1", "--bootstrap", "0"],
    }[command]


COMMANDS = ["gamma", "devices", "tenant-hash", "calibrate", "validate", "efficiency", "report"]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_full_disk_on_standard_output_is_one_line_and_exit_2(tmp_path, command):
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            [*PTE, *pte_argv(command, tmp_path)], stdout=full, stderr=subprocess.PIPE, text=True, timeout=300
        )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == EXIT_BAD_INPUT, r.stderr
    assert lines[-1] == f"pte {command}: error: cannot write to standard output: No space left on device", (
        lines
    )
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr


@pytest.mark.parametrize("command", ["calibrate", "efficiency"])
def test_standard_output_closed_early_is_no_error(tmp_path, command):
    """``pte … | head -1``: the reader leaves; nothing is said about it."""
    p = subprocess.Popen([*PTE, *pte_argv(command, tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # before the command writes anything
    err = p.stderr.read().decode()
    p.wait(timeout=300)
    assert "Traceback" not in err and "Exception ignored" not in err and "error" not in err, err


# --------------------------------------------------------------------------- an input twice


def test_efficiency_refuses_a_records_file_given_twice(tmp_path, capsys):
    path = records(tmp_path)
    twin = tmp_path / "sub" / "link.jsonl"
    twin.parent.mkdir()
    twin.symlink_to(path)
    err = one_line_error(["efficiency", str(path), str(twin), "--reference", "a", "--bootstrap", "0"], capsys)
    assert f"{twin} is {path} again" in err, err


def test_report_device_with_gamma_is_a_usage_error(tmp_path, capsys):
    """γ given directly has no device to apply to: --device would be ignored."""
    argv = ["report", str(trajectories(tmp_path)), "--gamma", "0.1", "--device", "h100", "--bootstrap", "0"]
    err = one_line_error(argv, capsys)
    assert "--device" in err and "--model-dir" in err, err


def test_efficiency_filter_without_an_lm_eval_output_is_a_usage_error(tmp_path, capsys):
    """--filter picks lm-eval's filter: on Inspect AI logs alone it would be ignored."""
    from tests.cli.test_efficiency_harness_cli import request_line
    from tests.offline.test_harness_readers import echo_eval

    run = echo_eval(tmp_path / "logs")
    # the requests that served its two samples, inside the run's time
    start, end = (
        datetime.fromisoformat(t).timestamp() for t in (run.stats.started_at, run.stats.completed_at)
    )
    at = (start + end) / 2
    lines = [request_line(f"r{k}", text, at, 2) for k, text in enumerate(("hi", "x"))]
    for line in lines:
        line["arrived_at"] = line["finished_at"] = at
    log = tmp_path / "requests.jsonl"
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))
    argv = ["efficiency", str(tmp_path / "logs"), "--request-log", str(log), "--bootstrap", "0"]
    assert main(argv) == 0, capsys.readouterr().err  # joined without --filter
    capsys.readouterr()
    err = one_line_error([*argv, "--filter", "none"], capsys)
    assert "--filter" in err and "lm-eval" in err, err
