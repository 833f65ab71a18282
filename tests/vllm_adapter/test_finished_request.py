"""What the stat logger reads from vLLM's own stats: the real ``FinishedRequestStats`` class,
filled by hand as vLLM's ``IterationStats.update_from_finished_request`` fills it, and the
real ``IterationStats`` driven through a request's outputs as vLLM's output loop drives it."""

import time

import pytest
from vllm.v1.engine import EngineCoreOutput, FinishReason
from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, LoRARequestStates, RequestStateStats

from pte_instrument.vllm_adapter.stat_logger import FirstTokenLatencies, finished_request


def stats(tokens: int, e2e: float, decode: float) -> FinishedRequestStats:
    return FinishedRequestStats(
        finish_reason="length",
        request_id="cmpl-r-0",
        e2e_latency=e2e,
        num_prompt_tokens=40,
        num_generation_tokens=tokens,
        queued_time=0.25,
        prefill_time=0.5,
        decode_time=decode,
        inference_time=0.5 + decode,
        mean_time_per_output_token=decode / (tokens - 1) if tokens > 1 else 0,
    )


def test_time_to_first_token_and_per_output_token():
    r = finished_request(stats(tokens=17, e2e=3.0, decode=2.0), "tiny", 0, iteration_timestamp=1000.0)
    assert r.ttft_s == pytest.approx(1.0) and r.tpot_s == pytest.approx(0.125)  # 2 s over 16 tokens
    assert (r.arrived_at, r.finished_at, r.e2e_s) == (997.0, 1000.0, 3.0)


def test_one_token_has_no_time_per_output_token_and_none_no_first_token():
    one = finished_request(stats(tokens=1, e2e=0.75, decode=0.0), "tiny", 0, iteration_timestamp=1000.0)
    assert one.ttft_s == pytest.approx(0.75) and one.tpot_s is None
    none = finished_request(stats(tokens=0, e2e=0.75, decode=0.0), "tiny", 0, iteration_timestamp=1000.0)
    assert none.ttft_s is None and none.tpot_s is None


def test_a_wall_clock_stepped_back_during_a_request_gives_no_negative_time():
    """vLLM measures a request's end-to-end and first-token latencies on the wall clock: one
    set back (NTP) while the request ran makes them negative. The record says zero, ends at
    the finish and starts no later (a histogram drops a negative value, a span would end
    before it starts)."""
    r = finished_request(stats(tokens=17, e2e=-0.5, decode=0.25), "tiny", 0, iteration_timestamp=1000.0)
    assert (r.e2e_s, r.ttft_s, r.arrived_at, r.finished_at) == (0.0, 0.0, 1000.0, 1000.0)
    latencies = FirstTokenLatencies()
    latencies.observe(_iteration_with_first_token(timestamp=999.0, latency=-1.5))
    r = finished_request(
        stats(tokens=17, e2e=-1.0, decode=0.25),
        "tiny",
        0,
        iteration_timestamp=999.5,
        first_token_latencies=latencies,
    )
    assert (r.e2e_s, r.ttft_s, r.arrived_at) == (0.0, 0.0, 999.5)
    assert len(latencies) == 0  # its entry taken, not left to the bound


def _iteration_with_first_token(timestamp: float, latency: float) -> IterationStats:
    it = _iteration(timestamp)
    it.time_to_first_tokens_iter.append(latency)
    return it


def _iteration(timestamp: float) -> IterationStats:
    it = IterationStats()
    it.iteration_timestamp = timestamp
    return it


def _output(token: int, finished: bool = False) -> EngineCoreOutput:
    return EngineCoreOutput(
        request_id="r-0", new_token_ids=[token], finish_reason=FinishReason.LENGTH if finished else None
    )


def test_time_to_first_token_is_vllms_own_when_the_last_output_reaches_the_api_server_late():
    """vLLM's output loop, driven as it drives it: the first token's batch reaches this
    process at once, the last one 150 ms after the engine sent it (a busy host). vLLM's
    own time to first token is that of the first batch, so the record's must be too — not
    the finish's ``e2e − decode``, which would carry the last batch's delay."""
    arrival = time.time() - 10.0
    req = RequestStateStats(arrival_time=arrival)
    lora = LoRARequestStates(log_stats=True)
    first = _iteration(arrival + 0.25)
    first.update_from_output(_output(7), 500.0, True, req, lora, None)
    last = _iteration(arrival + 0.25 + 0.5 + 0.15)
    last.update_from_output(_output(8, finished=True), 500.5, False, req, lora, None)
    last.update_from_finished_request(FinishReason.LENGTH, "cmpl-r-0", 40, 2, req)
    latencies = FirstTokenLatencies()
    records = []
    for it in (first, last):
        latencies.observe(it)
        for stats in it.finished_requests:
            records.append(finished_request(stats, "tiny", 0, it.iteration_timestamp, latencies))
    (r,) = records
    assert r.ttft_s == req.first_token_latency  # bit-exact: both are vLLM's subtraction
    assert r.ttft_s == pytest.approx(0.25) and r.e2e_s == pytest.approx(0.9)
    assert not latencies  # nothing kept once the request finished


def test_first_token_latencies_stay_bounded_when_requests_never_finish():
    """Requests aborted after their first token never reach vLLM's finish stats: their
    entries go, oldest first, once the bound is reached."""
    latencies = FirstTokenLatencies(limit=3)
    for i in range(5):
        it = _iteration(1000.0 + i)
        it.time_to_first_tokens_iter.append(0.5)
        latencies.observe(it)
    assert len(latencies) == 3
    assert latencies.pop(999.5) is None and latencies.pop(1003.5) == 0.5
