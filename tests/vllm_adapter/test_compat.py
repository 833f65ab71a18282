"""How vLLM names requests, read in one place (hand-written ids as vLLM 0.32 makes them)."""

import pytest

from pte_instrument.vllm_adapter.compat import external_request_id, request_keys


@pytest.mark.parametrize(
    ("internal", "expected"),
    [
        ("chatcmpl-abc-0123abcd", ("chatcmpl-abc", None)),  # the engine's random suffix
        ("cmpl-abc-0-89abcdef", ("cmpl-abc-0", None)),  # a prompt of /v1/completions
        ("0_chatcmpl-abc-0123abcd", ("chatcmpl-abc", 0)),  # parallel sampling: child 0
        ("12_cmpl-abc-1-0123abcd", ("cmpl-abc-1", 12)),
        ("chatcmpl-x_y-0123abcd", ("chatcmpl-x_y", None)),  # an underscore in a client's id
        ("a_b", ("a_b", None)),
        ("no-suffix", ("no-suffix", None)),
    ],
)
def test_external_request_id(internal, expected):
    assert external_request_id(internal) == expected


def test_request_keys_cover_the_middlewares_spellings():
    assert request_keys("chatcmpl-abc") == ("chatcmpl-abc", "abc")
    assert request_keys("cmpl-abc-1") == ("cmpl-abc-1", "abc")  # never "abc-1": another request's id
    assert request_keys("plain") == ("plain",)


def test_engine_transport_tcp_is_derived_from_the_data_parallel_settings():
    from types import SimpleNamespace

    from vllm.config import ParallelConfig

    from pte_instrument.vllm_adapter.compat import engine_transport

    parallel = ParallelConfig(
        data_parallel_size=2,
        data_parallel_size_local=1,
        data_parallel_master_ip="10.1.2.3",
        data_parallel_rpc_port=13345,
    )
    config = SimpleNamespace(parallel_config=parallel)  # the one part of VllmConfig it reads
    assert engine_transport(config, "tcp") == "tcp://10.1.2.3:13445"
    assert engine_transport(config, " TCP ") == "tcp://10.1.2.3:13445"
    config.parallel_config.reconfigure_for_independent_dp_rank()  # what vLLM does to an engine
    assert engine_transport(config, "tcp") == "tcp://10.1.2.3:13445"
    assert engine_transport(config, "ipc:///tmp/pte-1") == "ipc:///tmp/pte-1"
    assert engine_transport(config, "tcp://h:7") == "tcp://h:7"
    assert engine_transport(config, None) is None
