"""The declared messages: what the engine sends is what the API server decodes, a malformed
batch is refused whole, and the step log keeps its field order."""

import json
import queue
import uuid

import msgspec
import numpy as np
import pytest
import zmq

from pte_instrument.transport import Receiver, address_for
from pte_instrument.wire import (
    STEP_LOG_FIELDS,
    EngineFaults,
    EngineHello,
    RequestTotals,
    StepLogHeader,
    StepLogLine,
    decode_batch,
    decode_step_log,
    encode_batch,
    encode_step_log,
)


def test_a_batch_round_trips_with_its_types():
    batch = [
        EngineHello(1),
        EngineFaults(1, {"engine_step": 3}),
        RequestTotals("r-0123abcd", "r", engine=1, finish_reason="stop", prompt_tokens=7, ctx=(33.0, 12.0)),
    ]
    assert decode_batch(encode_batch(batch)) == batch


@pytest.mark.parametrize(
    "data",
    [
        b"not msgpack",
        msgspec.msgpack.encode([{"type": "totals", "engine": 0}]),  # required fields missing
        msgspec.msgpack.encode([{"type": "goodbye", "engine": 0}]),  # unknown message
        msgspec.msgpack.encode([{"type": "hello", "engine": "zero"}]),  # wrong type
    ],
)
def test_a_malformed_batch_is_refused(data):
    with pytest.raises(ValueError):
        decode_batch(data)


def test_the_receiver_counts_a_malformed_batch_and_keeps_receiving(tmp_path):
    address = address_for(f"ipc://{tmp_path}/pte-{uuid.uuid4().hex[:6]}", 0)
    inbox: queue.Queue = queue.Queue()
    receiver = Receiver(address, inbox.put)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(address)
    push.send(b"\x00garbage")
    push.send(encode_batch([EngineHello(3)]))
    assert inbox.get(timeout=5) == [EngineHello(3)]
    assert receiver.errors == 1
    push.close(0)


def test_step_log_lines_keep_their_field_order_and_round_trip():
    line = StepLogLine(
        engine=0,
        step=4,
        t=1.5,
        n_reqs=2,
        tokens=11,
        prefill=10,
        recompute=0,
        decode_tokens=1,
        spec_tokens=0,
        ctx=[33.0],
        pte=10.33,
        roofline_pte=10.0,
        weights_pte=1.0,
        hook_s=2e-6,
        dt_s=0.01,
    )
    text = encode_step_log(line)
    assert text.endswith("\n") and list(json.loads(text)) == list(STEP_LOG_FIELDS)
    assert decode_step_log(text) == line
    header = StepLogHeader(
        engine=0,
        gammas=[0.01],
        windows=[None],
        n_active=100.0,
        n_total=100.0,
        hoi=1.0,
        device="unit",
        weights_pte=1.0,
    )
    assert json.loads(encode_step_log(header))["header"] is True
    assert decode_step_log(encode_step_log(header)) == header
    with pytest.raises(ValueError):
        decode_step_log('{"engine": 0, "step": "four"}')


def test_a_step_log_line_with_numpy_numbers_encodes_as_plain_json():
    """The hook's values may come out of numpy (a clock, a reduction): they are written as the
    numbers they are, not refused (the encoder would otherwise raise inside the step)."""
    line = StepLogLine(
        engine=0,
        step=np.int64(3),
        t=np.float64(1.5),
        n_reqs=2,
        tokens=np.int32(9),
        prefill=8,
        recompute=0,
        decode_tokens=1,
        spec_tokens=0,
        ctx=[np.float64(7.0), 2.0],
        pte=np.float32(0.5),
        roofline_pte=1.0,
        weights_pte=0.0,
        hook_s=1e-5,
        dt_s=np.float64(0.25),
    )
    fields = json.loads(encode_step_log(line))
    assert (fields["step"], fields["t"], fields["tokens"], fields["ctx"], fields["pte"], fields["dt_s"]) == (
        3,
        1.5,
        9,
        [7.0, 2.0],
        0.5,
        0.25,
    )
    assert decode_step_log(encode_step_log(line)).dt_s == 0.25
