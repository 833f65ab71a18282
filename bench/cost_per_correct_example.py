"""An example cost-per-correct report (not a test): a real vLLM server with the plugin on the
tiny model (step hook, request log, a price), both harnesses' own commands on the local task
of tests/fixtures/harness at two ``max_tokens`` limits each, then ``pte efficiency`` on their
outputs and the request log. Writes bench/results/cost-per-correct-<hostname>-<date>/ with the
harness outputs, the request log, the report (text and JSON) and its plots.

    python -m bench.cost_per_correct_example [--limits 4,16] [--price 2.5]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.provenance import provenance, results_path
from pte_instrument.devtools.harnesses import BIN, offline_env, run_inspect, run_lm_eval
from pte_instrument.devtools.serving import VllmServer

ROOT = Path(__file__).resolve().parents[1]
TASK_DIR = ROOT / "tests" / "fixtures" / "harness"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limits", default="4,16", help="max_tokens of the runs, comma-separated")
    ap.add_argument("--price", type=float, default=2.5, help="USD per GPU-hour")
    ap.add_argument("--model-dir", type=Path, default=ROOT / "models" / "tiny")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    limits = [int(x) for x in args.limits.split(",")]
    prov = provenance()
    out = args.out or results_path("cost-per-correct").with_suffix("")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    log = out / "requests.jsonl"
    store = tempfile.mkdtemp()  # the server's session store: not part of the example
    env = {
        "PTE_REQUEST_LOG": str(log),
        "VLLM_PLUGINS": "pte",
        "PTE_GPU_HOURLY_PRICE": str(args.price),
        "PTE_SESSION_STORE": str(Path(store) / "sessions.sqlite3"),
    }
    hook = ["--scheduler-cls", "pte_instrument.vllm_adapter.scheduler.PteScheduler", "--enforce-eager"]
    runs, labels = [], []
    with VllmServer(args.model_dir, env=env, extra_args=hook, log_path=out / "vllm.log") as server:
        harness_env = offline_env(out)
        for n in limits:
            runs.append(
                run_lm_eval(
                    server.url, server.served_name, TASK_DIR, "letters", out / f"lm-eval-{n}", n, harness_env
                )
            )
            labels.append(f"lm-eval-max{n}")
        for n in limits:
            runs.append(
                run_inspect(
                    server.url,
                    server.served_name,
                    TASK_DIR,
                    "letters_inspect.py",
                    out / f"inspect-{n}",
                    n,
                    harness_env,
                    stop="e",
                )
            )
            labels.append(f"inspect-max{n}")
    shutil.rmtree(out / "hf", ignore_errors=True)  # lm-eval's dataset cache
    shutil.rmtree(store, ignore_errors=True)
    command = [
        str(BIN / "pte"),
        "efficiency",
        *(str(r.relative_to(out)) for r in runs),
        "--request-log",
        log.name,
        "--labels",
        ",".join(labels),
    ]
    text = subprocess.run(command, cwd=out, capture_output=True, text=True, check=True)
    (out / "report.txt").write_text(text.stdout)
    data = subprocess.run(
        [*command, "--json", "--plots", "plots"], cwd=out, capture_output=True, text=True, check=True
    )
    report = json.loads(data.stdout)
    (out / "report.json").write_text(
        json.dumps({**prov, "command": command[1:], "report": report}, indent=1, sort_keys=True)
    )
    sys.stdout.write(text.stdout)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
