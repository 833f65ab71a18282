"""Plugin configuration from environment variables (documented in the README).

A malformed value never stops the server: it is reported in ``errors`` (one clear line
each) and the default is used instead.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field

from pte_instrument import failpoints, transport
from pte_instrument.cost.architecture import N_ACTIVE_MAX, N_ACTIVE_MIN
from pte_instrument.cost.devices import HOI_MAX, device_names

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class Bounds:
    """The documented range of a numeric setting (docs/configuration.md). Finite always:
    a value such as 1e308 parses as a float but overflows γ or the ledgers' arithmetic."""

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


def _plain(x: float) -> str:
    """1000000 rather than 1e+06 where the digits stay readable."""
    return str(int(x)) if x == int(x) and abs(x) < 1e9 else f"{x:g}"


BOUNDS: dict[str, Bounds] = {
    "PTE_HOI": Bounds(0.0, HOI_MAX, low_open=True, unit=" FLOP/byte"),
    "PTE_N_ACTIVE": Bounds(N_ACTIVE_MIN, N_ACTIVE_MAX, unit=" parameters"),
    "PTE_MAX_SESSIONS": Bounds(1, 1_000_000, whole=True),
    "PTE_MAX_TURNS": Bounds(1, 100_000, whole=True),
    "PTE_FEEDBACK_WINDOW": Bounds(1, 10_000_000, whole=True),
    "PTE_SESSION_IDLE_TTL_S": Bounds(0.0, 31_536_000, low_open=True, unit=" s"),  # one year
    "PTE_GPU_HOURLY_PRICE": Bounds(0.0, 10_000, low_open=True, unit=" USD per GPU-hour"),
    "PTE_MAX_LORA_NAMES": Bounds(1, 10_000, whole=True),
}

# Every PTE_* variable the plugin reads (docs/configuration.md): any other is named as a typo.
NAMES = frozenset(
    {
        "PTE_ACCUMULATOR",
        "PTE_BENCHMARK_LABELS",
        "PTE_CALIBRATION",
        "PTE_DEVICE",
        "PTE_ENABLED",
        "PTE_ENGINE_TRANSPORT",
        "PTE_FAILPOINTS",
        "PTE_FAILPOINTS_SEED",
        "PTE_FEEDBACK_WINDOW",
        "PTE_GPU_HOURLY_PRICE",
        "PTE_HOI",
        "PTE_MAX_LORA_NAMES",
        "PTE_MAX_SESSIONS",
        "PTE_MAX_TURNS",
        "PTE_N_ACTIVE",
        "PTE_OTEL",
        "PTE_OTEL_LOGS",
        "PTE_OTEL_METRICS",
        "PTE_REQUEST_LOG",
        "PTE_SESSION_FROM_USER",
        "PTE_SESSION_HEADER",
        "PTE_SESSION_IDLE_TTL_S",
        "PTE_SESSION_STORE",
        "PTE_STEP_LOG",
        "PTE_TENANTS",
        "PTE_TENANT_FROM_API_KEY",
        "PTE_TENANT_HEADER",
    }
)

# Tenants: allow-listed values of a metric label, so both their length and their number are capped.
OTHER_TENANT = "other"  # every value not on the allow-list (or none), when tenants are on
MAX_TENANT_LEN = 64
MAX_TENANTS = 1000


def default_session_store(port: int | None = None) -> str:
    """One file per server (its port) and user, in the temporary directory: every API
    server of one ``vllm serve`` finds it, another server on the host has its own, and it
    survives the server's restart."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    name = "sessions.sqlite3" if port is None else f"sessions-{port}.sqlite3"
    return os.path.join(tempfile.gettempdir(), f"pte-instrument-{uid}", name)


@dataclass(frozen=True)
class Settings:
    enabled: bool = True
    device: str = "auto"
    hoi: float | None = None
    n_active: float | None = None
    request_log: str | None = None
    session_header: str = "X-Session-Id"
    session_from_user: bool = False
    max_sessions: int = 5000
    session_store: str | None = None  # the host's session store (None: a private one per process)
    session_idle_ttl_s: float = 3600.0
    max_turns: int = 64
    feedback_window: int = 50_000
    otel: bool = False
    otel_logs: bool = False  # a log record per priced request (OTLP), for a fleet's collector
    otel_metrics: bool = False  # GenAI server and pte.* metrics over OTLP
    accumulator_backend: str = "auto"
    step_log: str | None = None
    benchmark_header: str = "X-PTE-Benchmark"
    benchmark_labels: frozenset[str] = frozenset()
    gpu_hourly_price: float | None = None  # USD per GPU-hour: money off when unset
    calibration: str = "online"  # off | online | the path of a saved step-time fit
    tenant_header: str | None = None  # request header naming the tenant (None: not read)
    tenant_from_api_key: bool = False  # the tenant is a short hash of the request's API key
    tenants: frozenset[str] = frozenset()  # the allow-list; any other tenant is OTHER_TENANT
    max_lora_names: int = 64  # LoRA adapters accounted under their own name, per API server
    errors: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        errors: list[str] = []
        for name in sorted(n for n in env if n.startswith("PTE_")):
            if name not in NAMES:
                errors.append(f"{name[:64]} is not a pte-instrument setting (a typo?); ignoring it")
            elif not env[name].strip():
                errors.append(f"{name} is empty; using its default")
        env = {k: v for k, v in env.items() if (k in NAMES and v.strip()) or not k.startswith("PTE_")}

        def flag(name: str, default: bool) -> bool:
            raw = env.get(name)
            if raw is None:
                return default
            low = raw.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            errors.append(f"{name}={shown(raw)} is not a boolean (use 1/0, true/false); using {default}")
            return default

        def number(name: str, default: float | None) -> float | None:
            """The value within BOUNDS[name], else ``default`` (None: no override)."""
            raw = env.get(name)
            if raw is None:
                return default
            bounds = BOUNDS[name]
            try:
                value = float(raw)
            except ValueError:
                value = math.nan
            if bounds.admits(value):
                return int(value) if bounds.whole else value
            fallback = "ignoring it" if default is None else f"using {default:g}"
            errors.append(f"{name}={shown(raw)} must be {bounds.describe()}; {fallback}")
            return default

        def count(name: str, default: int) -> int:
            return int(number(name, default) or default)

        device = (env.get("PTE_DEVICE") or "auto").strip()
        if device.lower() not in device_names():  # else the cost model could not be built
            errors.append(
                f"PTE_DEVICE={shown(device)} is not a device profile (known: {', '.join(device_names())}); using auto"
            )
            device = "auto"

        header = (env.get("PTE_SESSION_HEADER") or "X-Session-Id").strip()
        if not _header_name(header):
            errors.append(
                f"PTE_SESSION_HEADER={shown(header)} is not a valid header name; using X-Session-Id"
            )
            header = "X-Session-Id"
        tenant_header: str | None = (env.get("PTE_TENANT_HEADER") or "").strip() or None
        if tenant_header is not None and not _header_name(tenant_header):
            errors.append(f"PTE_TENANT_HEADER={shown(tenant_header)} is not a valid header name; ignoring it")
            tenant_header = None
        tenant_from_api_key = flag("PTE_TENANT_FROM_API_KEY", False)
        tenants = _tenant_list(env.get("PTE_TENANTS") or "", errors)
        if tenants and tenant_header is None and not tenant_from_api_key:
            errors.append(
                "PTE_TENANTS is set but neither PTE_TENANT_HEADER nor PTE_TENANT_FROM_API_KEY: "
                "tenants are off"
            )
        elif not tenants and (tenant_header is not None or tenant_from_api_key):
            errors.append(
                f"PTE_TENANTS lists no tenant: every request is accounted to tenant {OTHER_TENANT!r}"
            )
        # OpenTelemetry follows its own standard variables: on when an OTLP endpoint is set.
        otel_default = bool(
            env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        )
        backend = (env.get("PTE_ACCUMULATOR") or "auto").strip().lower()
        if backend not in ("auto", "numpy", "torch", "triton"):
            errors.append(
                f"PTE_ACCUMULATOR={shown(backend)} is not one of auto, numpy, torch, triton; using auto"
            )
            backend = "auto"
        calibration = (env.get("PTE_CALIBRATION") or "online").strip()
        if calibration.lower() in ("off", "online"):
            calibration = calibration.lower()
        elif not os.path.isfile(calibration):
            errors.append(
                f"PTE_CALIBRATION={shown(calibration)} is not off, online or a saved fit's file; using online"
            )
            calibration = "online"
        for name, check in (
            (failpoints.SPEC_ENV, lambda v: failpoints.parse(v)[1]),
            (failpoints.SEED_ENV, lambda v: failpoints.parse_seed(v)[1]),
            (transport.ADDRESS_ENV, transport.address_problem),
        ):
            raw = env.get(name)
            if raw is not None and (problem := check(raw)) is not None:
                fix = "; using a local ipc:// address" if name == transport.ADDRESS_ENV else ""
                errors.append(f"{name}={shown(raw)}: {problem}{fix}")
        return cls(
            enabled=flag("PTE_ENABLED", True),
            device=device,
            hoi=number("PTE_HOI", None),
            n_active=number("PTE_N_ACTIVE", None),
            request_log=(env.get("PTE_REQUEST_LOG") or "").strip() or None,
            session_header=header,
            session_from_user=flag("PTE_SESSION_FROM_USER", False),
            max_sessions=count("PTE_MAX_SESSIONS", 5000),
            session_store=(env.get("PTE_SESSION_STORE") or "").strip() or default_session_store(),
            session_idle_ttl_s=number("PTE_SESSION_IDLE_TTL_S", 3600.0) or 3600.0,
            max_turns=count("PTE_MAX_TURNS", 64),
            feedback_window=count("PTE_FEEDBACK_WINDOW", 50_000),
            otel=flag("PTE_OTEL", otel_default) and not flag("OTEL_SDK_DISABLED", False),
            # on where logs have somewhere to go: the base endpoint or the logs endpoint
            otel_logs=flag(
                "PTE_OTEL_LOGS",
                bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT")),
            )
            and not flag("OTEL_SDK_DISABLED", False),
            # likewise: the base endpoint or the metrics endpoint
            otel_metrics=flag(
                "PTE_OTEL_METRICS",
                bool(
                    env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
                ),
            )
            and not flag("OTEL_SDK_DISABLED", False),
            accumulator_backend=backend,
            step_log=(env.get("PTE_STEP_LOG") or "").strip() or None,
            benchmark_labels=frozenset(
                label.strip() for label in (env.get("PTE_BENCHMARK_LABELS") or "").split(",") if label.strip()
            ),
            gpu_hourly_price=number("PTE_GPU_HOURLY_PRICE", None),
            calibration=calibration,
            tenant_header=tenant_header,
            tenant_from_api_key=tenant_from_api_key,
            tenants=tenants,
            max_lora_names=count("PTE_MAX_LORA_NAMES", 64),
            errors=tuple(errors),
        )


def shown(value: str, limit: int = 64) -> str:
    """A setting's value quoted for a log line, cut to ``limit`` characters."""
    return repr(value) if len(value) <= limit else repr(value[:limit]) + "…"


def _header_name(name: str) -> bool:
    return bool(name) and name.isascii() and name.replace("-", "").replace("_", "").isalnum()


def tenant_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be an allow-listed tenant (None: it can). Tenants are metric label
    values: visible ASCII, at most ``MAX_TENANT_LEN`` characters, never the catch-all itself."""
    if name == OTHER_TENANT:
        return f"{OTHER_TENANT!r} is the catch-all for every other tenant"
    if len(name) > MAX_TENANT_LEN:
        return f"longer than {MAX_TENANT_LEN} characters"
    if not name.isascii() or any(not 0x21 <= ord(c) <= 0x7E for c in name):
        return "not visible ASCII"
    return None


def _tenant_list(raw: str, errors: list[str]) -> frozenset[str]:
    """``PTE_TENANTS``: comma-separated names; an unusable one is named in one line and left
    out, the others kept (one typo should not put every team under ``other``)."""
    names: list[str] = []
    for name in (part.strip() for part in raw.split(",")):
        if not name or name in names:
            continue
        problem = tenant_name_problem(name)
        if problem is not None:
            errors.append(
                f"PTE_TENANTS: {name[:MAX_TENANT_LEN]!r} is not a usable tenant ({problem}); left out"
            )
        elif len(names) == MAX_TENANTS:
            errors.append(
                f"PTE_TENANTS lists more than {MAX_TENANTS} tenants; the first {MAX_TENANTS} are kept"
            )
            break
        else:
            names.append(name)
    return frozenset(names)
