"""Plugin configuration from environment variables (documented in the README).

A malformed value never stops the server: it is reported in ``errors`` (one clear line
each) and the default is used instead.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


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
    session_idle_ttl_s: float = 3600.0
    max_turns: int = 64
    feedback_window: int = 50_000
    otel: bool = False
    accumulator_backend: str = "auto"
    step_log: str | None = None
    benchmark_header: str = "X-PTE-Benchmark"
    benchmark_labels: frozenset[str] = frozenset()
    errors: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        errors: list[str] = []

        def flag(name: str, default: bool) -> bool:
            raw = env.get(name)
            if raw is None:
                return default
            low = raw.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            errors.append(f"{name}={raw!r} is not a boolean (use 1/0, true/false); using {default}")
            return default

        def positive(name: str) -> float | None:
            raw = env.get(name)
            if raw is None or not raw.strip():
                return None
            try:
                value = float(raw)
            except ValueError:
                value = float("nan")
            if not value > 0 or value == float("inf"):
                errors.append(f"{name}={raw!r} must be a positive number; ignoring it")
                return None
            return value

        def count(name: str, default: int) -> int:
            value = positive(name)
            if value is not None and value != int(value):
                errors.append(f"{name}={env[name]!r} must be a whole number; using {default}")
                value = None
            return default if value is None else int(value)

        header = (env.get("PTE_SESSION_HEADER") or "X-Session-Id").strip()
        if not header.isascii() or not header.replace("-", "").replace("_", "").isalnum():
            errors.append(f"PTE_SESSION_HEADER={header!r} is not a valid header name; using X-Session-Id")
            header = "X-Session-Id"
        # OpenTelemetry follows its own standard variables: on when an OTLP endpoint is set.
        otel_default = bool(
            env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        )
        backend = (env.get("PTE_ACCUMULATOR") or "auto").strip().lower()
        if backend not in ("auto", "numpy", "torch", "triton"):
            errors.append(f"PTE_ACCUMULATOR={backend!r} is not one of auto, numpy, torch, triton; using auto")
            backend = "auto"
        return cls(
            enabled=flag("PTE_ENABLED", True),
            device=(env.get("PTE_DEVICE") or "auto").strip(),
            hoi=positive("PTE_HOI"),
            n_active=positive("PTE_N_ACTIVE"),
            request_log=(env.get("PTE_REQUEST_LOG") or "").strip() or None,
            session_header=header,
            session_from_user=flag("PTE_SESSION_FROM_USER", False),
            max_sessions=count("PTE_MAX_SESSIONS", 5000),
            session_idle_ttl_s=positive("PTE_SESSION_IDLE_TTL_S") or 3600.0,
            max_turns=count("PTE_MAX_TURNS", 64),
            feedback_window=count("PTE_FEEDBACK_WINDOW", 50_000),
            otel=flag("PTE_OTEL", otel_default) and not flag("OTEL_SDK_DISABLED", False),
            accumulator_backend=backend,
            step_log=(env.get("PTE_STEP_LOG") or "").strip() or None,
            benchmark_labels=frozenset(
                label.strip() for label in (env.get("PTE_BENCHMARK_LABELS") or "").split(",") if label.strip()
            ),
            errors=tuple(errors),
        )
