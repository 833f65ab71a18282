"""The engine → API-server transport: every API server binds its own socket and receives
only the totals of the requests it submitted."""

import queue
import uuid

from pte_instrument.transport import Receiver, Sender, address_for
from pte_instrument.wire import RequestTotals


def totals(external_id: str) -> RequestTotals:
    return RequestTotals(external_id, external_id, engine=0, finish_reason="stop")


def test_each_api_server_receives_only_its_messages(tmp_path):
    base = f"ipc://{tmp_path}/pte-{uuid.uuid4().hex[:6]}"
    inbox: dict[int, queue.Queue] = {i: queue.Queue() for i in range(2)}
    receivers = [Receiver(address_for(base, i), inbox[i].put) for i in range(2)]
    sender = Sender(base)
    sender.send([totals("a"), totals("b")], api_server=1)
    sender.send([totals("c")], api_server=0)
    assert [m.external_id for m in inbox[1].get(timeout=5)] == ["a", "b"]
    assert [m.external_id for m in inbox[0].get(timeout=5)] == ["c"]
    assert inbox[0].empty() and inbox[1].empty() and sender.dropped == 0
    sender.close()
    assert receivers[0].errors == receivers[1].errors == 0
