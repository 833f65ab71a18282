"""Settings no value of which stops the plugin: an empty value means the default, with one
line; a malformed fault-injection spec or seed, or an engine transport address that is not
one, is named in one line and replaced by what works."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pte_instrument import failpoints, settings, transport
from pte_instrument.settings import NAMES, Settings

FLAGS = [
    "PTE_ENABLED",
    "PTE_OTEL",
    "PTE_OTEL_LOGS",
    "PTE_OTEL_METRICS",
    "PTE_SESSION_FROM_USER",
    "PTE_TENANT_FROM_API_KEY",
]


@pytest.mark.parametrize("name", FLAGS)
@pytest.mark.parametrize("raw", ["", "  "])
def test_an_empty_flag_means_its_default_with_one_line(name, raw):
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}  # every OTel flag defaults on
    default = Settings.from_env(endpoint)
    s = Settings.from_env({**endpoint, name: raw})
    field = name.removeprefix("PTE_").lower()
    assert getattr(s, field) == getattr(default, field)
    assert [e for e in s.errors if name in e] == [f"{name} is empty; using its default"]


def test_an_empty_pte_enabled_keeps_the_plugin_on():
    assert Settings.from_env({"PTE_ENABLED": ""}).enabled is True


@pytest.mark.parametrize("raw", ["abc", "", "1.5", "nan", "1e308", "-1"])
def test_a_bad_failpoint_seed_is_named_and_seed_0_used(raw):
    seed, problem = settings.parse_failpoint_seed(raw)
    assert seed == 0 and problem is not None
    assert any("PTE_FAILPOINTS_SEED" in e for e in Settings.from_env({"PTE_FAILPOINTS_SEED": raw}).errors)


def test_a_good_failpoint_seed_is_taken():
    assert settings.parse_failpoint_seed("7") == (7, None)
    assert settings.parse_failpoint_seed(None) == (0, None)


@pytest.mark.parametrize(
    "spec", ["prometheus:x", "routes:2", "routes:-0.5", ":0.5", "routes:nan", "no_such_stage"]
)
def test_a_malformed_failpoint_spec_is_named_and_injects_nothing(spec):
    points, problem = settings.parse_failpoints(spec)
    assert points == {} and problem is not None
    assert any("PTE_FAILPOINTS=" in e for e in Settings.from_env({"PTE_FAILPOINTS": spec}).errors)


def test_a_good_failpoint_spec_is_taken():
    assert settings.parse_failpoints("prometheus:0.25, routes") == ({"prometheus": 0.25, "routes": 1.0}, None)


@pytest.mark.parametrize(
    "address",
    [
        "tcp://127.0.0.1:abc",
        "tcp://127.0.0.1",
        "tcp://:5555",
        "tcp://h:70000",
        "udp://x",
        "ipc://",
        "garbage",
    ],
)
def test_an_engine_transport_that_is_not_an_address_is_named_and_replaced(address, monkeypatch):
    monkeypatch.setenv(transport.ADDRESS_ENV, address)
    assert transport.address_problem(address) is not None
    fixed = transport.ensure_address(settings.read(transport.ADDRESS_ENV))
    assert fixed.startswith("ipc://") and transport.address_problem(fixed) is None
    assert transport.address_for(fixed, 1) == f"{fixed}-1"
    assert any(transport.ADDRESS_ENV in e for e in Settings.from_env({transport.ADDRESS_ENV: address}).errors)


@pytest.mark.parametrize("address", ["tcp", "TCP", "tcp://10.0.0.1:5555", "ipc:///tmp/pte-x"])
def test_a_good_engine_transport_is_kept(address, monkeypatch):
    monkeypatch.setenv(transport.ADDRESS_ENV, address)
    assert (
        transport.address_problem(address) is None
        and transport.ensure_address(settings.read(transport.ADDRESS_ENV)) == address
    )
    assert not Settings.from_env({transport.ADDRESS_ENV: address}).errors


def test_every_failpoint_in_the_code_is_a_known_stage():
    import re

    from tests.conftest import ROOT

    used = set()
    for path in (ROOT / "pte_instrument").rglob("*.py"):
        used |= set(re.findall(r"(?:failpoint|fires)\(\"([a-z_]+)\"\)", path.read_text(encoding="utf-8")))
    assert used == set(failpoints.STAGES)


GARBAGE = {
    "empty": "",
    "blank": "   ",
    "negative": "-1",
    "nan": "nan",
    "inf": "inf",
    "1e308": "1e308",
    "non-numeric": "abc",
    "huge": "9" * 4000,
    "control": "a\x01b",
}


@pytest.mark.parametrize("garbage", GARBAGE)
@pytest.mark.parametrize("name", sorted(NAMES))
def test_every_setting_takes_every_garbage_value_or_names_it_in_one_line(name, garbage):
    """No value stops the plugin, and none is dropped in silence: the setting either takes it
    as given (a path, a header or a tenant named ``abc`` are fine) or says so in one line."""
    value = GARBAGE[garbage]
    context = {"PTE_TENANT_HEADER": "X-Tenant"} if name == "PTE_TENANTS" else {}  # tenants need a source
    settings = Settings.from_env({**context, name: value})
    consequence = "PTE_TENANTS lists no tenant"  # the tenant header's line: every request is "other"
    named = [e for e in settings.errors if name in e and not e.startswith(consequence)]
    assert len(named) <= 1, named
    taken = dataclasses.replace(settings, errors=()) != dataclasses.replace(
        Settings.from_env(context), errors=()
    )
    assert taken != bool(named), (name, garbage, settings.errors)
    assert all(len(e) < 600 for e in settings.errors)  # a huge value is not echoed whole


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        ("PTE_FAILPOINTS_SEED", "²"),
        ("PTE_FAILPOINTS_SEED", "①"),
        ("PTE_ENGINE_TRANSPORT", "tcp://10.0.0.1:²"),
        ("PTE_ENGINE_TRANSPORT", "tcp://10.0.0.1:٥٥٥٥"),  # int() reads it; a socket does not
    ],
)
def test_a_digit_that_is_not_ascii_is_named_in_one_line_not_raised(name, raw):
    s = Settings.from_env({name: raw})
    assert [e.split("=")[0] for e in s.errors] == [name]
    assert (s.failpoints_seed, s.engine_transport) == (0, None)
    assert settings.read(name, {name: raw})[1] is not None  # what failpoints and the launcher read


@pytest.mark.parametrize(
    "store",
    [
        ":memory:",  # SQLite's: every connection of the store would see an empty database of its own
        "valkey://redis.internal:6379",
        "unix:///run/redis.sock",
    ],
)
def test_a_session_store_that_is_neither_a_file_nor_a_redis_url_is_named_and_the_default_used(store):
    s = Settings.from_env({"PTE_SESSION_STORE": store})
    assert s.session_store == Settings.from_env({}).session_store
    assert len(s.errors) == 1 and s.errors[0].startswith(f"PTE_SESSION_STORE={store!r} ")


@pytest.mark.parametrize("store", ["REDIS://redis.internal:6379/0", "Rediss://redis.internal:6380"])
def test_a_redis_url_is_one_whatever_the_case_of_its_scheme(store):
    from pte_instrument.settings import is_redis_url

    s = Settings.from_env({"PTE_SESSION_STORE": store})
    assert s.session_store == store and not s.errors and is_redis_url(store)


def test_redis_over_a_unix_socket_is_said_to_be_unsupported():
    s = Settings.from_env({"PTE_SESSION_STORE": "unix:///run/redis.sock"})
    assert len(s.errors) == 1 and "a Unix socket" in s.errors[0]


GOOD_FIT = {"format": "pte-step-time", "version": 1, "a": 1e-5, "b": 1e-8, "w": 1e-3, "o": 1e-3}


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("", "not valid JSON"),
        ("not json", "not valid JSON"),
        ("[]", "must be a JSON object"),
        ('{"a": 1}', "not a step-time model"),
        ('{"format": "pte-step-time", "version": 1, "a": NaN, "b": 0, "w": 0, "o": 0}', "NaN"),
        ('{"format": "pte-step-time", "version": 1, "a": 1e400, "b": 0, "w": 0, "o": 0}', "term 'a'"),
        (
            '{"format": "pte-step-time", "version": 1, "a": 1' + "0" * 400 + ', "b": 0, "w": 0, "o": 0}',
            "term 'a'",
        ),
        ('{"format": "pte-step-time", "version": 1' + "0" * 400 + "}", "version"),
    ],
)
def test_a_calibration_file_that_is_not_a_saved_fit_is_named_and_online_used(tmp_path, content, why):
    """The engine hook reads the file at start-up: a file it could not read would turn the
    hook off, every request priced without its engine totals."""
    path = tmp_path / "fit.json"
    path.write_text(content)
    s = Settings.from_env({"PTE_CALIBRATION": str(path)})
    assert s.calibration == "online"
    [line] = s.errors
    assert line.startswith("PTE_CALIBRATION=") and why in line and line.endswith("; using online")
    assert "\n" not in line and len(line) < 600


def test_a_saved_fit_is_taken_as_the_calibration(tmp_path):
    path = tmp_path / "fit.json"
    path.write_text(json.dumps(GOOD_FIT))
    s = Settings.from_env({"PTE_CALIBRATION": str(path)})
    assert (s.calibration, s.errors) == (str(path), ())
