"""What the stat logger reads from vLLM's own finish stats (the real ``FinishedRequestStats``
class, filled by hand as vLLM's ``IterationStats.update_from_finished_request`` fills it)."""

import pytest
from vllm.v1.metrics.stats import FinishedRequestStats

from pte_instrument.vllm_adapter.stat_logger import finished_request


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
