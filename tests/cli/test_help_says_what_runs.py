"""``pte <command> --help`` says what the command really does: the dtype it times, the defaults
it falls back on, the log an option applies to."""

from __future__ import annotations

import argparse
import json

import pytest

from pte_instrument.cli.main import build_parser, main


@pytest.fixture(autouse=True)
def wide_help(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # no phrase of a help text broken over two lines


def help_of(command: str) -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command].format_help()


def test_devices_measure_help_names_the_dtype_timed_on_each_device() -> None:
    text = help_of("devices")
    # measure_profile times bf16 on a GPU and fp32 on a CPU (bf16 there is emulated)
    assert "fp32 on a CPU" in text and "bf16 on a GPU" in text
    assert "also time a bf16 matmul" not in text


def test_devices_table_does_not_call_a_measured_cpus_fp32_rate_bf16(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["devices", "--measure", "--measure-device", "cpu", "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)[-1]
    assert measured["name"] == "measured:cpu" and "float32" in measured["source"]
    assert main(["devices", "--measure", "--measure-device", "cpu"]) == 0
    table = capsys.readouterr().out
    assert "measured:cpu" in table and "TFLOP/s" in table
    assert "bf16 TFLOP/s" not in table  # the column holds the fp32 rate of this row


def test_validate_help_names_its_defaults() -> None:
    text = help_of("validate")
    assert "default pte-validation" in text  # where a run without --out writes
    assert "default 1000" in text
    defaults = build_parser().parse_args(["validate", "requests.jsonl"])
    assert defaults.out == "pte-validation" and defaults.bootstrap == 1000


def test_report_help_says_plots_are_for_trajectories() -> None:
    line = next(ln for ln in help_of("report").splitlines() if ln.strip().startswith("--plots"))
    assert "trajectories:" in line  # a request log with --plots is refused
