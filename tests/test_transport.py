"""The engine → API-server transport: every API server binds its own socket and receives
only the totals of the requests it submitted."""

import queue
import time
import uuid

from pte_instrument.transport import Receiver, Sender, address_for
from pte_instrument.wire import RequestTotals, encode_batch


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


def test_a_full_queue_drops_and_the_engine_sender_counts_it(tmp_path, monkeypatch):
    """Nobody receiving and a tiny queue: sends that cannot be queued are dropped, never
    block, and each dropped batch is a fault the hook reports later."""
    from pte_instrument import transport
    from pte_instrument.engine.sender import EngineSender
    from pte_instrument.faults import FaultTracker
    from pte_instrument.wire import EngineFaults

    monkeypatch.setattr(transport, "HIGH_WATER_MARK", 1)
    base = f"ipc://{tmp_path}/pte-{uuid.uuid4().hex[:6]}"
    faults = FaultTracker()
    engine_sender = EngineSender(Sender(base), engine=0, faults=faults)
    for i in range(50):
        engine_sender.send([totals(f"r{i}")])
    assert engine_sender.sender.dropped > 0
    assert faults.counts["engine_transport"] == engine_sender.sender.dropped_batches > 0
    inbox: queue.Queue = queue.Queue()  # the API server comes up: the drops reach it, counted
    receiver = Receiver(address_for(base, 0), inbox.put)
    reported = 0
    for _ in range(100):
        engine_sender.send([])
        while not inbox.empty():
            reported += sum(
                m.counts.get("engine_transport", 0) for m in inbox.get() if isinstance(m, EngineFaults)
            )
        if reported == faults.counts["engine_transport"]:
            break
        time.sleep(0.05)
    assert reported == faults.counts["engine_transport"]
    engine_sender.close()
    assert receiver.errors == 0


def test_the_receiver_reports_each_malformed_batch(tmp_path):
    import zmq

    address = address_for(f"ipc://{tmp_path}/pte-{uuid.uuid4().hex[:6]}", 0)
    errors: list[Exception] = []
    inbox: queue.Queue = queue.Queue()
    Receiver(address, inbox.put, on_error=errors.append)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(address)
    push.send(b"\x00garbage")
    push.send(encode_batch([]))
    inbox.get(timeout=5)
    assert len(errors) == 1 and isinstance(errors[0], ValueError)
    push.close(0)


def test_over_tcp_api_server_i_listens_on_the_base_port_plus_i():
    from pte_instrument.devtools.serving import free_port

    base = f"tcp://127.0.0.1:{free_port() - 1}"  # API server 1's port is the free one
    assert address_for("tcp://10.0.0.5:29650", 2) == "tcp://10.0.0.5:29652"
    assert address_for("ipc:///tmp/pte-1", 2) == "ipc:///tmp/pte-1-2"
    inbox: queue.Queue = queue.Queue()
    Receiver(address_for(base, 1), inbox.put)
    sender = Sender(base)
    assert sender.send([totals("over-tcp")], api_server=1)
    assert [m.external_id for m in inbox.get(timeout=5)] == ["over-tcp"]
    sender.close()


def test_what_a_sender_queued_before_it_closed_arrives_after_its_process_exits(tmp_path):
    """A process sends, closes its sender and exits at once (the pricing process at the
    engine's shutdown): the batches it queued still reach a live API server."""
    import subprocess
    import sys

    base = f"ipc://{tmp_path}/pte-{uuid.uuid4().hex[:6]}"
    inbox: queue.Queue = queue.Queue()
    receiver = Receiver(address_for(base, 0), inbox.put)
    script = (
        "from pte_instrument.transport import Sender\n"
        "from pte_instrument.wire import RequestTotals\n"
        f"s = Sender({base!r})\n"
        "for i in range(200):\n"
        "    s.send([RequestTotals(f'r{i}', f'r{i}', engine=0, finish_reason='stop')] * 50)\n"
        "s.close()\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    got = 0
    while got < 200:
        try:
            inbox.get(timeout=5)
        except queue.Empty:
            break
        got += 1
    assert got == 200 and receiver.errors == 0


def test_every_api_server_hears_that_an_engine_reported_faults_and_only_api_server_0_counts_them(tmp_path):
    """A fault may have lost totals that any API server waits for: each stops waiting longer
    than the least for them, and the faults are counted once in the merged metrics."""
    from pte_instrument.engine.sender import EngineSender
    from pte_instrument.faults import FaultTracker
    from pte_instrument.server.engine_join import EngineInbox

    base = f"ipc://{tmp_path}/pte-{uuid.uuid4().hex[:6]}"
    inboxes = [EngineInbox(FaultTracker(), lambda stage, n: None) for _ in range(2)]
    got: queue.Queue = queue.Queue()

    def on_messages(i: int):
        return lambda messages: (inboxes[i].on_messages(messages), got.put(i))

    receivers = [Receiver(address_for(base, i), on_messages(i)) for i in range(2)]
    engine_sender = EngineSender(Sender(base), engine=0, faults=FaultTracker())
    engine_sender.hello(api_servers=2)
    engine_sender.send([RequestTotals("r", "r", engine=0, finish_reason="stop", api_server=1)])
    for _ in range(3):  # the hellos, the totals
        got.get(timeout=5)
    assert [inbox.fault_said.get(0) for inbox in inboxes] == [None, False]
    engine_sender.fault("finish", RuntimeError("a pricing pass failed"))
    for _ in range(2):
        got.get(timeout=5)
    assert [inbox.fault_said.get(0) for inbox in inboxes] == [True, True]
    assert [inbox.faults.counts["engine_finish"] for inbox in inboxes] == [1, 0]
    engine_sender.close()
    assert receivers[0].errors == receivers[1].errors == 0


def test_an_ipc_path_too_long_for_a_unix_socket_is_a_problem_named_before_any_bind():
    """A Unix socket's path holds 107 bytes: a longer base would fail every API server's bind
    (engines' totals lost); named at start-up instead, and a local base used."""
    import zmq

    from pte_instrument.transport import address_problem

    room = zmq.IPC_PATH_MAX_LEN - len("-999")  # the API server's suffix
    assert address_problem("ipc:///" + "x" * (room - 1)) is None
    problem = address_problem("ipc:///" + "x" * room)
    assert problem == f"an ipc:// path must be at most {room} bytes (a Unix socket's)"
    assert address_problem("ipc:///tmp/" + "é" * (room // 2)) == problem  # bytes, not characters


def test_a_batch_past_the_size_limit_is_never_read_and_later_batches_still_arrive(tmp_path, monkeypatch):
    """The receiving socket takes any sender (tcp for engines on other nodes): a batch past
    MAX_BATCH_BYTES is dropped by the socket before it is held whole, and the rest go on."""
    import zmq

    from pte_instrument import transport

    monkeypatch.setattr(transport, "MAX_BATCH_BYTES", 4096)
    got: queue.Queue = queue.Queue()
    address = f"ipc://{tmp_path}/big-0"
    receiver = Receiver(address, got.put)
    big = encode_batch([totals(f"big-{i}" + "x" * 100) for i in range(100)])
    assert len(big) > 4096
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(address)
    push.send(big)  # first: without the limit it is the first batch received
    push.close()
    sender = Sender(f"ipc://{tmp_path}/big")
    sender.send([totals("small")], api_server=0)
    batch = got.get(timeout=10)
    assert [m.external_id for m in batch] == ["small"]
    assert receiver.errors == 0
    sender.close()


def test_the_base_made_for_a_server_fits_a_unix_socket_under_a_long_temporary_directory(monkeypatch):
    import tempfile

    from pte_instrument.transport import ADDRESS_ENV, MAX_IPC_BASE, address_problem, ensure_address

    # set, then removed: the base ensure_address exports is taken back after the test (a later
    # test's hooks would otherwise start pricing processes and senders toward it)
    monkeypatch.setenv(ADDRESS_ENV, "")
    monkeypatch.delenv(ADDRESS_ENV)
    monkeypatch.setattr(tempfile, "gettempdir", lambda: "/tmp/" + "d" * 120)
    address = ensure_address((None, None))
    assert address_problem(address) is None and len(address.removeprefix("ipc://")) <= MAX_IPC_BASE


def test_a_sender_collected_in_a_reference_cycle_without_close_neither_hangs_nor_loses_its_batch(tmp_path):
    """An owner dropped without closing its sender, in a cycle the garbage collector breaks:
    pyzmq's own clean-up terms the context while the sockets it can no longer see are open,
    and waits for ever. The sender is closed as ``close()`` would, and what it queued arrives."""
    import subprocess
    import sys

    base = f"ipc://{tmp_path}/pte-{uuid.uuid4().hex[:6]}"
    inbox: queue.Queue = queue.Queue()
    receiver = Receiver(address_for(base, 0), inbox.put)
    script = (
        "import gc\n"
        "from pte_instrument.transport import Sender\n"
        "from pte_instrument.wire import RequestTotals\n"
        "class Owner:\n"
        "    pass\n"
        "owner = Owner()\n"
        f"owner.sender = Sender({base!r})\n"
        "owner.me = owner\n"
        "owner.sender.send([RequestTotals('r', 'r', engine=0, finish_reason='stop')])\n"
        "del owner\n"
        "gc.collect()\n"
        "print('collected', flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=20)
    assert done.returncode == 0 and "collected" in done.stdout, done.stderr
    assert [m.request_id for m in inbox.get(timeout=5)] == ["r"] and receiver.errors == 0
