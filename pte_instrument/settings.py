"""Plugin configuration from environment variables, declared once in ``TABLE``: each
setting's variable, field, type, default, parser (with its bounds) and help. ``Settings``,
the README's and docs/configuration.md's tables (``scripts/settings_tables.py``) are made
from it. Every read of a ``PTE_*`` variable goes through this module.

A malformed value never stops the server: it is reported in ``errors`` (one clear line
each) and the default is used instead.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pte_instrument.cost.architecture import N_ACTIVE_MAX, N_ACTIVE_MIN
from pte_instrument.cost.devices import HOI_MAX, device_names

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}

# The request header a client names its evaluation's label in (PTE_BENCHMARK_LABELS).
BENCHMARK_HEADER = "X-PTE-Benchmark"

# Tenants: allow-listed values of a metric label, so both their length and their number are capped.
OTHER_TENANT = "other"  # every value not on the allow-list (or none), when tenants are on
MAX_TENANT_LEN = 64
MAX_TENANTS = 1000

# The OpenTelemetry SDK's own variables that decide the OTel settings' defaults.
OTLP_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
OTEL_SDK_DISABLED = "OTEL_SDK_DISABLED"


class Invalid(ValueError):
    """A value a parser rejects; its message completes ``<NAME>=<value> …``."""


@dataclass(frozen=True)
class Bounds:
    """The documented range of a numeric setting. Finite always: a value such as 1e308
    parses as a float but overflows γ or the ledgers' arithmetic."""

    low: float
    high: float
    low_open: bool = False  # ``low`` itself excluded: a positive quantity
    whole: bool = False
    unit: str = ""

    def admits(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low  # NaN: False
        return above and value <= self.high and (not self.whole or value == int(value))

    def describe(self) -> str:
        kind = "whole number" if self.whole else "number"
        if self.low_open:
            return f"a positive {kind} of at most {_plain(self.high)}{self.unit}"
        return f"a {kind} from {_plain(self.low)} to {_plain(self.high)}{self.unit}"

    def interval(self) -> str:
        """The range as the docs write it: ``number in (0, 100000] FLOP/byte``."""
        kind = "whole number" if self.whole else "number"
        low, high = _written(self.low), _written(self.high)
        return f"{kind} in {'(' if self.low_open else '['}{low}, {high}]{self.unit}"


def _plain(x: float) -> str:
    """1000000 rather than 1e+06 where the digits stay readable."""
    return str(int(x)) if x == int(x) and abs(x) < 1e9 else f"{x:g}"


def _written(x: float) -> str:
    """``_plain``, but a large power of ten as 10¹⁴."""
    exponent = round(math.log10(x)) if x >= 1e9 else 0
    if exponent and x == 10.0**exponent:
        return "10" + str(exponent).translate(str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹"))
    return _plain(x)


# --- parsers: a stripped, non-empty value → the setting's value, or Invalid -----------------

Parser = Callable[[str, list[str]], Any]  # (value, lines of a partial acceptance) → value


class number:
    """A number within its bounds (a whole one where ``whole``)."""

    def __init__(
        self, low: float, high: float, *, low_open: bool = False, whole: bool = False, unit: str = ""
    ) -> None:
        self.bounds = Bounds(low, high, low_open, whole, unit)

    def __call__(self, raw: str, _: list[str]) -> float | int:
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not self.bounds.admits(value):
            raise Invalid(f"must be {self.bounds.describe()}")
        return int(value) if self.bounds.whole else value


class choice:
    def __init__(self, *options: str) -> None:
        self.options = options

    def __call__(self, raw: str, _: list[str]) -> str:
        if raw.lower() not in self.options:
            raise Invalid(f"is not one of {', '.join(self.options)}")
        return raw.lower()


def _flag(raw: str, _: list[str]) -> bool:
    low = raw.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise Invalid("is not a boolean (use 1/0, true/false)")


def _text(raw: str, _: list[str]) -> str:
    return raw


MAX_INSTANCE_LEN = 128


def _instance(raw: str, _: list[str]) -> str:
    if len(raw) > MAX_INSTANCE_LEN or not raw.isprintable():
        raise Invalid(f"is not a replica name (printable, at most {MAX_INSTANCE_LEN} characters)")
    return raw


def default_instance(port: int | None = None) -> str:
    """This host's name, and the server's port when known: one name per replica."""
    host = socket.gethostname() or "localhost"
    return host if port is None else f"{host}:{port}"


def _labels(raw: str, lines: list[str]) -> frozenset[str]:
    return _allow_list(raw, lines, "PTE_BENCHMARK_LABELS", "benchmark label", ("other", "none"))


def _header(raw: str, _: list[str]) -> str:
    if not (raw.isascii() and raw.replace("-", "").replace("_", "").isalnum()):
        raise Invalid("is not a valid header name")
    return raw


def _device(raw: str, _: list[str]) -> str:
    if raw.lower() not in device_names():  # else the cost model could not be built
        raise Invalid(f"is not a device profile (known: {', '.join(device_names())})")
    return raw


def _calibration(raw: str, _: list[str]) -> str:
    if raw.lower() in ("off", "online"):
        return raw.lower()
    if not os.path.isfile(raw):
        raise Invalid("is not off, online or a saved fit's file")
    from pte_instrument.cost.step_time import StepTimeModel

    try:  # read here, where a bad file is one line: the engine hook reading it would turn off
        StepTimeModel.load(raw)
    except ValueError as e:
        why = str(e) if len(str(e)) <= 200 else str(e)[:200] + "…"
        raise Invalid(f"is not a saved fit ({why})") from None
    return raw


# The stages with a failpoint (``request_log``: a disk that fills in the middle of a record).
FAILPOINT_STAGES = ("engine_step", "prometheus", "request_log", "routes", "session_store", "transport")


def parse_failpoints(spec: str | None) -> tuple[dict[str, float], str | None]:
    """The points of a spec, and why it is unusable (None: it is; else no point at all)."""
    points: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in (spec or "").split(","))):
        stage, _, raw = item.partition(":")
        try:
            prob = float(raw) if raw.strip() else 1.0
        except ValueError:
            prob = math.nan
        if stage.strip() not in FAILPOINT_STAGES or not 0.0 <= prob <= 1.0:  # NaN fails both
            return {}, (
                f"has {item[:40]!r}, which is not stage:probability (a stage of {', '.join(FAILPOINT_STAGES)}; "
                "a number from 0 to 1)"
            )
        points[stage.strip()] = prob
    return points, None


def parse_failpoint_seed(raw: str | None) -> tuple[int, str | None]:
    if raw is None:
        return 0, None
    if raw.strip().isascii() and raw.strip().isdigit():  # isdigit alone takes "²", which int() refuses
        return int(raw), None
    return 0, "is not a whole number of 0 or more"


def _failpoints(raw: str, _: list[str]) -> tuple[tuple[str, float], ...]:
    points, problem = parse_failpoints(raw)
    if problem is not None:
        raise Invalid(problem)
    return tuple(points.items())


def _seed(raw: str, _: list[str]) -> int:
    seed, problem = parse_failpoint_seed(raw)
    if problem is not None:
        raise Invalid(problem)
    return seed


def _transport(raw: str, _: list[str]) -> str:
    from pte_instrument import transport

    if (problem := transport.address_problem(raw)) is not None:
        raise Invalid(f"is not an address: {problem}")
    return raw


def label_value_problem(name: str, reserved: tuple[str, ...]) -> str | None:
    """Why ``name`` cannot be an allow-listed metric label value (None: it can): visible ASCII
    (the header it comes in is read as Latin-1 bytes), at most ``MAX_TENANT_LEN`` characters,
    none of the values ``reserved`` for the catch-alls."""
    if name in reserved:
        return f"{name!r} is the plugin's catch-all for every other value, or none"
    if len(name) > MAX_TENANT_LEN:
        return f"longer than {MAX_TENANT_LEN} characters"
    if not name.isascii() or any(not 0x21 <= ord(c) <= 0x7E for c in name):
        return "not visible ASCII"
    return None


def _allow_list(
    raw: str, lines: list[str], variable: str, what: str, reserved: tuple[str, ...]
) -> frozenset[str]:
    """Comma-separated names; an unusable one is named in one line and left out, the others
    kept (one typo should not put every request under ``other``)."""
    names: list[str] = []
    for name in (part.strip() for part in raw.split(",")):
        if not name or name in names:
            continue
        problem = label_value_problem(name, reserved)
        if problem is not None:
            lines.append(
                f"{variable}: {name[:MAX_TENANT_LEN]!r} is not a usable {what} ({problem}); left out"
            )
        elif len(names) == MAX_TENANTS:
            lines.append(
                f"{variable} lists more than {MAX_TENANTS} {what}s; the first {MAX_TENANTS} are kept"
            )
            break
        else:
            names.append(name)
    return frozenset(names)


def _tenants(raw: str, lines: list[str]) -> frozenset[str]:
    return _allow_list(raw, lines, "PTE_TENANTS", "tenant", (OTHER_TENANT,))


def is_redis_url(store: str | None) -> bool:
    """Whether a session store names a Redis server (a URL's scheme knows no case)."""
    return store is not None and store.lower().startswith(("redis://", "rediss://"))


def _session_store(raw: str, _: list[str]) -> str:
    """A file, or a Redis URL. SQLite's ``:memory:`` would be an empty database per connection
    (nothing the store wrote could be read back), and another URL a relative file path."""
    if raw == ":memory:":
        raise Invalid("is SQLite's in-memory name, which each connection sees empty")
    if raw.lower().startswith("unix://"):
        raise Invalid("is Redis over a Unix socket, which the store does not take (redis://host:port)")
    if "://" in raw and not is_redis_url(raw):
        raise Invalid("is a URL, and not a redis://… or rediss://… one")
    return raw


def default_session_store(port: int | None = None) -> str:
    """One file per server (its port) and user, in the temporary directory: every API
    server of one ``vllm serve`` finds it, another server on the host has its own, and it
    survives the server's restart."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    name = "sessions.sqlite3" if port is None else f"sessions-{port}.sqlite3"
    return os.path.join(tempfile.gettempdir(), f"pte-instrument-{uid}", name)


def _otlp_endpoint(signal: str) -> Callable[[Mapping[str, str]], bool]:
    """On where the signal has somewhere to go: the base OTLP endpoint or the signal's own."""
    return lambda env: bool(env.get(OTLP_ENDPOINT) or env.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT"))


@dataclass(frozen=True)
class Setting:
    """One environment variable: what it sets, how it is read, and what the docs say of it."""

    name: str
    attr: str  # the Settings field
    type: Any
    default: Any  # unset, empty or malformed (and Settings()'s)
    parse: Parser
    help: str  # docs/configuration.md
    accepted: str | None = None  # None: a number's bounds say it
    summary: str | None = None  # the README's line (None: docs/configuration.md only)
    default_from: Callable[[Mapping[str, str]], Any] | None = None  # a default the environment decides
    fallback: str | None = None  # what a malformed value leads to, where not the default
    default_shown: str | None = None  # the docs' default, where not the value itself
    readme_default: str | None = None  # the README's, where shorter than the docs'

    def accepted_text(self) -> str:
        if self.accepted is not None:
            return self.accepted
        assert isinstance(self.parse, number)
        return self.parse.bounds.interval()

    def default_text(self, readme: bool = False) -> str:
        if readme and self.readme_default is not None:
            return self.readme_default
        if self.default_shown is not None:
            return self.default_shown
        d = self.default
        if d is None or d == frozenset() or d == ():
            return "–"
        if isinstance(d, bool):
            return "`1`" if d else "`0`"
        return f"`{_plain(d) if isinstance(d, float) else d}`"

    def fallback_text(self, default: Any) -> str:
        if self.fallback is not None:
            return self.fallback
        if default is None:
            return "ignoring it"
        if isinstance(default, bool):
            return f"using {'1' if default else '0'}"
        return f"using {_plain(default) if isinstance(default, float) else default}"


TABLE: tuple[Setting, ...] = (
    Setting(
        "PTE_ENABLED",
        "enabled",
        bool,
        True,
        _flag,
        accepted="`1`/`0`, `true`/`false`, `yes`/`no`, `on`/`off`",
        help="`0`: the plugin only logs that it is off; nothing is priced or exported",
        summary="`0` turns the plugin off (it then only logs that it is off)",
    ),
    Setting(
        "PTE_DEVICE",
        "device",
        str,
        "auto",
        _device,
        accepted="`auto`, `measured`, or a profile name from `pte devices` (`h100-sxm`, `h100-pcie`, `h200`, …; case-insensitive); another name is reported and `auto` used",
        help="device profile behind γ and HOI. `auto`: the local GPU when recognised, else `h100-sxm` (so a CPU server prices work as an H100 would); `measured`: time this host at start-up ([cost-model.md §3](cost-model.md#3-γ-from-first-principles))",
        summary="device profile for γ: `auto` (the local GPU; `h100-sxm` when none is recognised), `measured` (time this host at start-up), or a name from `pte devices`",
    ),
    Setting(
        "PTE_HOI",
        "hoi",
        float | None,
        None,
        number(0.0, HOI_MAX, low_open=True, unit=" FLOP/byte"),
        help="override the hardware operational intensity (peak FLOP/s ÷ memory bandwidth, FLOP/byte) of the profile",
        summary="override the hardware operational intensity (FLOP/byte)",
    ),
    Setting(
        "PTE_N_ACTIVE",
        "n_active",
        float | None,
        None,
        number(N_ACTIVE_MIN, N_ACTIVE_MAX, unit=" parameters"),
        help="override N_active, the matmul weights used per token (e.g. the model card's active-parameter count)",
        summary="override N_active (active parameters per token, e.g. the model card's figure)",
    ),
    Setting(
        "PTE_REQUEST_LOG",
        "request_log",
        str | None,
        None,
        _text,
        accepted="file path",
        help='write one JSON object per finished request (fields in the README); unset: no log. Checked at start-up (one log line if it cannot be written; serving goes on and each entry lost is counted in `pte_plugin_faults_total{stage="request_log"}`); rotation and a full disk: [below](#request-log-rotation-and-a-full-disk)',
        summary="path of the JSONL request log; unset = no log",
    ),
    Setting(
        "PTE_PROMPT_DIGEST",
        "prompt_digest",
        bool,
        True,
        _flag,
        accepted="boolean",
        help="with the request log and the routes plugin: each line carries `prompt_digest`, the SHA-256 of its prompt's roles and text (the prompt itself is never stored), which `pte efficiency` recomputes from an evaluation harness's log to join each sample to the requests that served it ([cost per correct answer](efficiency.md#cost-per-correct-answer-from-lm-eval-and-inspect-ai)); `0`: no digest, and the request body is not read for it",
        summary="`0`: no `prompt_digest` in the request log (it joins evaluation samples to their requests)",
    ),
    Setting(
        "PTE_PROMPT_DIGEST_KEY",
        "prompt_digest_key",
        str | None,
        None,
        _text,
        accepted="text",
        help="makes `prompt_digest` an HMAC-SHA-256 under this key, so that a digest cannot be checked against guessed prompts without it; give `pte efficiency` the same key (this variable) to join",
        default_shown="– (plain SHA-256)",
    ),
    Setting(
        "PTE_SESSION_HEADER",
        "session_header",
        str,
        "X-Session-Id",
        _header,
        accepted="an HTTP header name (ASCII letters, digits, `-`, `_`)",
        help="request header naming the agent session; needs the session middleware: `VLLM_PLUGINS=pte,<every other plugin you use>` (an allow-list: plugins it does not name are off) or vLLM's `--middleware` flag",
        summary="request header naming the agent session (needs the session middleware: `VLLM_PLUGINS=pte,<every other plugin you use>`, or vLLM's `--middleware` flag without `VLLM_PLUGINS`; [above](#agent-sessions-and-http-routes))",
    ),
    Setting(
        "PTE_SESSION_FROM_USER",
        "session_from_user",
        bool,
        False,
        _flag,
        accepted="boolean",
        help="`1`: take the session from the OpenAI `user` field when the header is absent",
        summary="`1`: take the session from the OpenAI `user` field when the header is absent",
    ),
    Setting(
        "PTE_SESSION_STORE",
        "session_store",
        str | None,
        None,
        _session_store,
        accepted="file path, or a `redis://…` / `rediss://…` URL",
        help="`redis://…` or `rediss://…`: a Redis (or Valkey) server shared by a fleet of replicas ([below](#a-fleet-of-replicas)). Otherwise the host's session store: one SQLite file (WAL) that every API server of the server shares, so a session's turns are one session whichever process each reaches, and that outlives a restart (a session continues its turn numbers; its first turn after the restart shows the eviction tax it paid). The default is private to the server (by the `--port` of `vllm serve`), so two servers on one host keep apart; two servers given the same file merge their sessions and totals, and a server that starts while another one writes to its file says so in one line. A file that cannot be opened (a directory, not a session store, an unwritable place): one log line, a fault counted in `pte_plugin_faults_total{stage=\"sessions\"}`, and a private store per process instead ([below](#the-session-store))",
        summary="the server's session store: one SQLite file all its API servers share (a session is one session whichever process each turn reaches) and that outlives a restart. The default is the server's own (by its `--port`); two servers given one file share sessions and totals, and the one that starts second says so in a line. A `redis://…` URL: one store a fleet of replicas shares",
        default_shown="`<temp dir>/pte-instrument-<uid>/sessions-<port>.sqlite3`",
        default_from=lambda env: default_session_store(),
    ),
    Setting(
        "PTE_SESSION_STORE_TIMEOUT_S",
        "session_store_timeout_s",
        float,
        0.25,
        number(0.0, 60.0, low_open=True, unit=" s"),
        help="a `redis://…` session store only: how long one command may take before it has failed; the store is then left alone for a back-off (1 s, doubling to 30 s); the turns and feedback-window observations it could not take are kept (up to 10,000 of each) and written once it answers, each once, and what is lost is counted. No request waits for the store: the pricing of finished requests and the store's writer do",
        summary="a Redis session store's command timeout (the pricing waits at most this long; no request does)",
    ),
    Setting(
        "PTE_INSTANCE",
        "instance",
        str,
        "",
        _instance,
        accepted=f"printable text, at most {MAX_INSTANCE_LEN} characters",
        help="this replica's name in a fleet that shares a session store: each turn records the replica that served it, and a turn served by another replica than its session's previous turn is charged a routing tax instead of an eviction tax ([below](#a-fleet-of-replicas))",
        summary="this replica's name in a fleet sharing a session store (routing tax: a turn served away from its previous turn's replica)",
        default_shown="`<hostname>:<port>`",
        default_from=lambda env: default_instance(),
    ),
    Setting(
        "PTE_MAX_SESSIONS",
        "max_sessions",
        int,
        5000,
        number(1, 1_000_000, whole=True),
        help='live sessions kept; past it the least recently active is closed (`pte_sessions_closed_total{reason="evicted"}`)',
        summary="live sessions kept; the least recently active is closed past it (counted)",
    ),
    Setting(
        "PTE_SESSION_IDLE_TTL_S",
        "session_idle_ttl_s",
        float,
        3600.0,
        number(0.0, 31_536_000, low_open=True, unit=" s"),
        help='a session without a turn for this long is closed (`reason="idle"`); session histograms are observed at close',
        summary="a session without a turn for this long is closed (counted)",
    ),
    Setting(
        "PTE_MAX_TURNS",
        "max_turns",
        int,
        64,
        number(1, 100_000, whole=True),
        help="turn rows kept per session; totals keep counting, dropped rows are counted",
        summary="turn rows kept per session (totals keep counting; dropped rows counted)",
    ),
    Setting(
        "PTE_FEEDBACK_WINDOW",
        "feedback_window",
        int,
        50_000,
        number(1, 10_000_000, whole=True),
        help="finished requests (and sessions) `POST /pte/feedback` can still label; older ones answer 404. Under 1 KB each (measured below: RSS +41 MiB over the first 50,000 ids, everything included)",
    ),
    Setting(
        "PTE_OTEL",
        "otel",
        bool,
        False,
        _flag,
        accepted="boolean",
        help="export one OpenTelemetry span per finished request; `OTEL_SDK_DISABLED=true` turns it off whatever this says",
        summary="`0`/`1`: export one OpenTelemetry span per request",
        default_shown="on when an OTLP endpoint is set",
        default_from=_otlp_endpoint("TRACES"),
    ),
    Setting(
        "PTE_OTEL_METRICS",
        "otel_metrics",
        bool,
        False,
        _flag,
        accepted="boolean",
        help="export the GenAI model-server metrics (`gen_ai.server.request.duration`, `gen_ai.server.time_to_first_token`, `gen_ai.server.time_per_output_token`) and the `pte.*` counters (`pte.served`, `pte.reference`, `pte.gpu.time`, `pte.cost`) over OTLP (README, OpenTelemetry); `OTEL_SDK_DISABLED=true` turns it off",
        summary="`0`/`1`: export the GenAI server metrics and `pte.*` counters over OTLP ([below](#opentelemetry))",
        default_shown="on when `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT` is set",
        readme_default="on when `OTEL_EXPORTER_OTLP_ENDPOINT` or `…_METRICS_ENDPOINT` is set",
        default_from=_otlp_endpoint("METRICS"),
    ),
    Setting(
        "PTE_OTEL_LOGS",
        "otel_logs",
        bool,
        False,
        _flag,
        accepted="boolean",
        help="export one OpenTelemetry log record per priced request (event `pte.request`, attributes: the request log's fields under the same names, unknown values left out), so a collector gathers every replica's ledger; `OTEL_SDK_DISABLED=true` turns it off",
        summary="`0`/`1`: export one OpenTelemetry log record per priced request, with the request log's fields (a fleet's collector gathers every replica's ledger)",
        default_shown="on when `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_LOGS_ENDPOINT` is set",
        readme_default="on when `OTEL_EXPORTER_OTLP_ENDPOINT` or `…_LOGS_ENDPOINT` is set",
        default_from=_otlp_endpoint("LOGS"),
    ),
    Setting(
        "PTE_BENCHMARK_LABELS",
        "benchmark_labels",
        frozenset[str],
        frozenset(),
        _labels,
        accepted="comma-separated labels",
        help="benchmark labels allowed on live efficiency metrics (visible ASCII, up to 64 characters each); a client sends one in `X-PTE-Benchmark`, any other value is counted as `other`, none as `none` (metric labels stay bounded)",
        summary="allow-listed benchmark labels (`X-PTE-Benchmark` header) for the live efficiency metrics",
    ),
    Setting(
        "PTE_TENANT_HEADER",
        "tenant_header",
        str | None,
        None,
        _header,
        accepted="an HTTP header name (ASCII letters, digits, `-`, `_`); another value is reported and ignored",
        help="request header naming the tenant ([below](#tenants-and-lora-adapters)); read by the session middleware (`VLLM_PLUGINS=pte` or `--middleware`). When a request carries it, it decides the tenant",
        summary="request header naming the tenant ([Tenants](#tenants))",
    ),
    Setting(
        "PTE_TENANT_FROM_API_KEY",
        "tenant_from_api_key",
        bool,
        False,
        _flag,
        accepted="boolean",
        help="`1`: a request without the tenant header is accounted to the hash of its API key (`Authorization: Bearer <key>`): the first 12 hex digits of its SHA-256 (`pte tenant-hash KEY`); the key itself is never kept",
        summary="`1`: the tenant is the API key's hash (`pte tenant-hash KEY`) when the header is absent",
    ),
    Setting(
        "PTE_TENANTS",
        "tenants",
        frozenset[str],
        frozenset(),
        _tenants,
        accepted="comma-separated names, at most 1,000, each at most 64 visible ASCII characters and not `other`; an unusable entry is named in one log line and left out, the others kept",
        help="the tenants kept as `tenant` label values (names, or API-key hashes); any other value, a malformed one or none is `other`. Set without a tenant source: one log line, tenants off; a source without this list: one log line, every request `other`",
        summary="allow-listed tenants (names or key hashes, comma-separated, at most 1,000 of at most 64 visible ASCII characters); any other is `other`",
    ),
    Setting(
        "PTE_MAX_LORA_NAMES",
        "max_lora_names",
        int,
        64,
        number(1, 10_000, whole=True),
        help="LoRA adapters accounted under their own name (`lora_name`) in each API server, the first that finish a request; later ones are `other`",
        summary="LoRA adapters accounted under their own name per API server ([LoRA adapters](#lora-adapters)); later ones are `other`",
    ),
    Setting(
        "PTE_FAILPOINTS",
        "failpoints",
        tuple[tuple[str, float], ...],
        (),
        _failpoints,
        accepted="`stage:probability,…`",
        help="testing only: inject faults (`engine_step`, `transport`, `prometheus`, `routes`; `request_log`: a full disk, half a record written then `ENOSPC`) to prove serving continues; a malformed spec (a probability outside [0, 1], no stage) is reported and injects nothing",
        fallback="no fault is injected",
    ),
    Setting(
        "PTE_FAILPOINTS_SEED",
        "failpoints_seed",
        int,
        0,
        _seed,
        accepted="whole number ≥ 0; another value is reported and 0 used",
        help="seed of the fault injection",
    ),
    Setting(
        "PTE_ACCUMULATOR",
        "accumulator_backend",
        str,
        "auto",
        choice("auto", "numpy", "torch", "triton"),
        accepted="`auto`, `numpy`, `torch`, `triton`",
        help="backend of the engine-side step accumulator (the `--scheduler-cls` hook); `auto`: numpy in the pricing process (`PTE_ENGINE_PRICING=process`), and with inline pricing Triton on CUDA when importable, else torch on CUDA, else numpy. `torch` or `triton` in the pricing process opens a CUDA context of its own there",
        summary="engine hook's accumulator: `numpy`, `torch`, `triton` (`auto`: numpy in the pricing process; inline, Triton on CUDA, else numpy)",
    ),
    Setting(
        "PTE_ENGINE_PRICING",
        "engine_pricing",
        str,
        "process",
        choice("process", "inline"),
        accepted="`process`, `inline`",
        help="where the engine hook prices its steps: `process`: in a pricing process of its own beside each engine core, which takes the completed steps from a 4 MiB shared-memory ring (in `/dev/shm`, else the temporary directory), woken by the pass (the engine thread keeps a reference to each step's scheduler output and hands each pass to a thread of the engine process, which reads the steps' rows and writes them as one message and one byte to the process's pipe while the engine thread waits for the model; an idle engine costs it no CPU); `inline`: on the engine thread, inside vLLM's scheduler calls (about a millisecond per pass). A pricing process that cannot start: one log line, counted in `pte_plugin_faults_total{stage=\"engine_setup\"}`, and `inline`",
        summary="where the engine hook prices its steps: `process` (its own process, off the engine thread) or `inline`",
    ),
    Setting(
        "PTE_STEP_LOG",
        "step_log",
        str | None,
        None,
        _text,
        accepted="file path",
        help='engine-side step log (JSONL: a header, then one line per scheduler step) for validation and γ calibration; engine *i* > 0 writes `<path>.engine<i>` (fields: [cost-model.md §5](cost-model.md#5-roofline-attribution)); the lines of a request\'s steps are in the file before its totals reach the API server. A path that cannot be opened turns off the step log only, with one log line per engine, counted in `pte_plugin_faults_total{stage="engine_step_log"}`; one that cannot be written later (a full disk) goes off too, said once and counted in `pte_plugin_faults_total{stage="engine_finish"}`, its buffered lines lost; the hook\'s accounting goes on',
        summary="engine-side step log (JSONL), for validation and γ calibration",
    ),
    Setting(
        "PTE_GPU_HOURLY_PRICE",
        "gpu_hourly_price",
        float | None,
        None,
        number(0.0, 10_000, low_open=True, unit=" USD per GPU-hour"),
        help="price of one GPU-hour: every request's and session's `cost_usd` = GPU seconds × GPUs per engine (tensor × pipeline parallel) × price ÷ 3600, and `pte_cost_usd_total`; unset: no money (needs the step hook for GPU seconds)",
        summary="USD per GPU-hour: turns on `cost_usd` per request and session and `pte_cost_usd_total` (GPUs per engine from tensor × pipeline parallel)",
    ),
    Setting(
        "PTE_CALIBRATION",
        "calibration",
        str,
        "online",
        _calibration,
        accepted="`off`, `online`, or a file",
        help="the engine's step-time model ([cost-model.md §5b](cost-model.md)), which splits each step's measured time over its requests: `off` keeps the theory values from the architecture and the device profile; `online` starts from them and refits the last 4,096 steps every 256 steps; a file written by `pte calibrate --save` starts from that fit and refits online too. A file that does not exist or holds no such fit: one log line, `online`",
        summary="the engine's step-time model: `off` (theory only), `online` (fitted to the engine's own steps), or a fit saved by `pte calibrate --save`",
    ),
    Setting(
        "PTE_ENGINE_TRANSPORT",
        "engine_transport",
        str | None,
        None,
        _transport,
        accepted="`tcp`, `tcp://host:port`, or an `ipc://…` base",
        help="the engine → API-server sockets. Unset: IPC; the plugin's `vllm.general_plugins` hook creates a base in the first vLLM process, the others inherit it, and API server `i` binds `<base>-i`. `tcp`: for engines on other nodes (`vllm serve … --headless`, started as a command of their own, which inherit nothing): set it on **every** node; each side derives `tcp://<--data-parallel-address>:<--data-parallel-rpc-port + 100>` from vLLM's data-parallel settings, and API server `i` listens on that port + `i`. `tcp://host:port`: that base, as given. An `ipc://` path is at most 103 bytes (a Unix socket's 107, less the `-i`). Any other value is reported in one line and replaced by a local `ipc://` base (every process of one `vllm serve` inherits the replacement). An engine whose hook cannot reach the API server while other engines' hooks can: its requests wait 2 s for its hook (an engine on another node connects when it can, and its first requests may finish before its hook is heard), then are priced without engine totals, each counted in `pte_plugin_faults_total{stage=\"engine_join\"}` with a log line that says so",
        default_shown="set automatically",
        fallback="using a local ipc:// address",
    ),
)


# Not the plugin's, but read as its own are: the OpenTelemetry SDK's off switch.
_SDK_DISABLED = Setting(OTEL_SDK_DISABLED, "otel_sdk_disabled", bool, False, _flag, help="")

BY_NAME: dict[str, Setting] = {s.name: s for s in TABLE}
# Every PTE_* variable the plugin reads: any other is named as a typo.
NAMES = frozenset(BY_NAME)


def _read(setting: Setting, env: Mapping[str, str], errors: list[str]) -> Any:
    default = setting.default_from(env) if setting.default_from is not None else setting.default
    raw = env.get(setting.name)
    if raw is None or not raw.strip():
        return default
    try:
        return setting.parse(raw.strip(), errors)
    except Invalid as e:
        errors.append(f"{setting.name}={shown(raw)} {e}; {setting.fallback_text(default)}")
        return default


def read(name: str, env: Mapping[str, str] | None = None) -> tuple[Any, str | None]:
    """One setting, for a module that needs it before ``Settings`` exist (at import, or in
    vLLM's launcher): its value (the default when unset, empty or malformed) and the line
    naming a malformed value (None: there is none)."""
    errors: list[str] = []
    value = _read(BY_NAME[name], os.environ if env is None else env, errors)
    return value, errors[0] if errors else None


def is_set(name: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether the environment gives ``name`` a value of its own (not empty)."""
    assert name in NAMES, name
    return bool((os.environ if env is None else env).get(name, "").strip())


def _from_env(cls: type, env: Mapping[str, str] | None = None) -> Any:
    """The settings of this process's environment (``env``: another one)."""
    env = os.environ if env is None else env
    errors: list[str] = []
    for name in sorted(n for n in env if n.startswith("PTE_")):
        if name not in NAMES:
            errors.append(f"{name[:64]} is not a pte-instrument setting (a typo?); ignoring it")
        elif not env[name].strip():
            errors.append(f"{name} is empty; using its default")
    values = {s.attr: _read(s, env, errors) for s in TABLE}
    if values["tenants"] and values["tenant_header"] is None and not values["tenant_from_api_key"]:
        errors.append(
            "PTE_TENANTS is set but neither PTE_TENANT_HEADER nor PTE_TENANT_FROM_API_KEY: tenants are off"
        )
    elif not values["tenants"] and (values["tenant_header"] is not None or values["tenant_from_api_key"]):
        errors.append(f"PTE_TENANTS lists no tenant: every request is accounted to tenant {OTHER_TENANT!r}")
    if _read(_SDK_DISABLED, env, errors):  # the OpenTelemetry SDK's own switch overrides ours
        values.update(otel=False, otel_logs=False, otel_metrics=False)
    return cls(**values, errors=tuple(errors))


Settings = dataclasses.make_dataclass(
    "Settings",
    [(s.attr, s.type, dataclasses.field(default=s.default)) for s in TABLE]
    + [("errors", tuple[str, ...], dataclasses.field(default=()))],
    frozen=True,
    namespace={"from_env": classmethod(_from_env)},
)
Settings.__module__ = __name__
Settings.__doc__ = "The plugin's settings: one field per row of ``TABLE``, and ``errors``, the lines naming what was malformed."


def shown(value: str, limit: int = 64) -> str:
    """A setting's value quoted for a log line, cut to ``limit`` characters."""
    return repr(value) if len(value) <= limit else repr(value[:limit]) + "…"


def markdown_table(readme: bool = False) -> str:
    """docs/configuration.md's table of every setting, or the README's shorter one."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    if readme:
        rows = ["| variable | default | meaning |", "|---|---|---|"]
        rows += [
            f"| `{s.name}` | {s.default_text(readme=True)} | {cell(s.summary)} |" for s in TABLE if s.summary
        ]
    else:
        rows = ["| variable | default | accepted values | meaning |", "|---|---|---|---|"]
        rows += [
            f"| `{s.name}` | {s.default_text()} | {cell(s.accepted_text())} | {cell(s.help)} |" for s in TABLE
        ]
    return "\n".join(rows) + "\n"
