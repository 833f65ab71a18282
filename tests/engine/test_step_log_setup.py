"""An unwritable step log turns off the step log only: the engine hook keeps its exact
accounting, and the fault reaches the API server with the hook's hello."""

from __future__ import annotations

import json

from pte_instrument.engine.accounting import EngineAccounting
from pte_instrument.engine.sender import EngineSender
from pte_instrument.faults import FaultTracker
from pte_instrument.wire import EngineFaults, EngineHello
from tests.engine.test_engine_accounting import COST, collect, completed


def test_an_unwritable_step_log_leaves_the_accounting_on(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    sent: list[dict] = []
    ea = EngineAccounting(COST, collect(sent), step_log=str(blocker / "steps.jsonl"))
    assert isinstance(ea.step_log_error, NotADirectoryError) and str(blocker) in str(ea.step_log_error)
    ea.price(completed([[("a", 0, 10)]], {"a": 10}))
    ea.on_finished("a", "length", {"prompt_tokens": 10, "output_tokens": 1, "num_preemptions": 0})
    ea.flush()
    ea.close()
    assert [(m["request_id"], m["prefill"]) for m in sent] == [("a", 10)]


def test_a_writable_step_log_reports_no_error(tmp_path):
    log = tmp_path / "steps.jsonl"
    ea = EngineAccounting(COST, collect([]), step_log=str(log))
    assert ea.step_log_error is None
    ea.price(completed([[("a", 0, 10)]], {"a": 10}))
    ea.close()
    header, line = (json.loads(x) for x in log.read_text().splitlines())
    assert (header["header"], header["engine"], header["gammas"]) == (True, 0, [0.01])
    assert (line["step"], line["prefill"], line["n_reqs"]) == (0, 10, 1)


class FakeSender:
    def __init__(self) -> None:
        self.batches: list[tuple[int, list]] = []

    def send(self, messages: list, api_server: int = 0) -> bool:
        self.batches.append((api_server, messages))
        return True


def test_faults_at_set_up_travel_with_the_hello():
    sender, faults = FakeSender(), FaultTracker()
    faults.record("engine_step_log", OSError("unwritable"), logged=True)
    engine_sender = EngineSender(sender, 0, faults)  # type: ignore[arg-type]
    engine_sender.hello(2)
    messages = [(i, m) for i, batch in sender.batches for m in batch]
    assert (0, EngineHello(0)) in messages and (1, EngineHello(0)) in messages
    assert (0, EngineFaults(0, {"engine_step_log": 1})) in messages
    n = len(sender.batches)
    engine_sender.send([])  # already reported: not again
    assert not any(isinstance(m, EngineFaults) for _, batch in sender.batches[n:] for m in batch)
