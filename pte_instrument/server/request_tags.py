"""Request tags: validating client-supplied session ids and trace contexts, and remembering
what a request carries (session, benchmark label, tenant, requested model, route, the
caller's trace) until the server reports it finished. Both bounded."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pte_instrument.server.bounded import BoundedDict

MAX_SESSION_ID_LEN = 128
# Bytes of an X-Request-Id passed to vLLM as sent: vLLM names its request after it, and the
# request log and the session store keep that name, so a longer one goes as its digest.
MAX_REQUEST_ID_LEN = 128
MAX_ECHO_LEN = 128
MAX_TRACEPARENT_LEN = 256  # W3C: 55 characters in version 00; later versions may append fields
# How long a tag stays after its HTTP exchange ends: longer than the longest wait before such
# a request is priced (a client that hung up on a request the engine still finished: vLLM's
# stat logger never reports it, and its engine totals are priced once orphaned, 5 s on, in
# ``engine_join``), with a margin for a slow transport and a busy pricing timer.
TAG_GRACE_S = 15.0


def quoted(value: str, limit: int = MAX_ECHO_LEN) -> str:
    """``value`` quoted for an error message, cut to ``limit`` characters (clients choose
    ids of any length; an answer should not echo megabytes back)."""
    return repr(value) if len(value) <= limit else repr(value[:limit]) + "…"


def validate_session_id(raw: bytes | str) -> tuple[str | None, str | None]:
    """``(session_id, None)`` for a usable id, else ``(None, reason)`` with reason one of
    ``empty``, ``too_long``, ``invalid_chars`` (a bounded set: it is a metric label)."""
    if isinstance(raw, str):
        try:
            raw = raw.encode("ascii")
        except UnicodeEncodeError:
            return None, "invalid_chars"
    if not raw.strip():
        return None, "empty"
    if len(raw) > MAX_SESSION_ID_LEN:
        return None, "too_long"
    if any(b < 0x21 or b > 0x7E for b in raw):  # visible ASCII only
        return None, "invalid_chars"
    return raw.decode("ascii"), None


def bounded_request_id(raw: bytes, as_sent: bool = True) -> bytes:
    """An ``X-Request-Id`` as vLLM is to see it: as sent, up to ``MAX_REQUEST_ID_LEN`` bytes;
    a longer one (or any, ``as_sent`` False) as its SHA-256 in hex (64 characters,
    ``printf %s "$ID" | sha256sum``): the same id each time it is sent, and one a client can
    compute."""
    if as_sent and len(raw) <= MAX_REQUEST_ID_LEN:
        return raw
    return hashlib.sha256(raw).hexdigest().encode("ascii")


def parse_traceparent(raw: bytes | str) -> str | None:
    """A W3C ``traceparent`` header as the propagator reads it, re-spelt in version 00
    (``00-<trace id>-<parent span id>-<flags>``); None for a malformed or all-zero one."""
    from opentelemetry.trace import format_span_id, format_trace_id, get_current_span
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    if isinstance(raw, bytes):
        raw = raw.decode("latin-1")
    if len(raw) > MAX_TRACEPARENT_LEN:
        return None
    ctx = get_current_span(TraceContextTextMapPropagator().extract({"traceparent": raw})).get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{format_trace_id(ctx.trace_id)}-{format_span_id(ctx.span_id)}-{int(ctx.trace_flags):02x}"


@dataclass(frozen=True)
class RequestTag:
    session_id: str | None
    benchmark: str  # an allow-listed label, "other", or "none"
    tenant: str | None = None  # an allow-listed tenant or "other"; None: tenants are off
    model: str | None = None  # the OpenAI "model" field (read when the server serves LoRA adapters)
    operation: str | None = None  # the GenAI operation of the route it came by (chat, text_completion)
    traceparent: str | None = None  # the caller's trace context (``parse_traceparent``)
    prompt_digests: tuple[str, ...] = ()  # one per prompt of the body (``prompt_digest``)

    @property
    def tracked(self) -> bool:
        """Whether it carries a session or a benchmark label: only such a tag's drop is
        counted (``PendingTags.dropped``); a route and a trace context alone are not."""
        return self.session_id is not None or self.benchmark != "none"

    @property
    def owner(self) -> tuple[str | None, str, str | None, str | None]:
        """Whose the request is (its session, benchmark, tenant and adapter): two requests open
        at once under one id with different owners cannot be told apart."""
        return self.session_id, self.benchmark, self.tenant, self.model


UNTAGGED = RequestTag(None, "none")  # a request that carries nothing to remember


@dataclass
class _Pending:
    tag: RequestTag
    since: float
    open: int = 1  # HTTP exchanges under this key still going (clients may reuse an id)
    claimed: bool = False
    clash: bool = False  # exchanges of different owners open under it at once: whose is whose is unknown


class PendingTags:
    """request key → tag, for requests not yet finished.

    One HTTP request can become several engine requests (``n > 1``, a list of prompts), so
    a tag is claimed without being removed (``claim``). It stays while its HTTP exchange
    is open and ``grace_s`` after it ends (``settle``): the stat logger sees a request
    finish before, or moments after, its answer goes out. A client that reuses a request id
    opens the key again; two exchanges of different owners open under one key at once tag
    neither request (which is whose cannot be told). Past ``max_age_s``, or past
    ``capacity`` (least recently added first), a tag goes in any case. ``dropped`` counts the tags that went unclaimed: their
    requests never reached the engine (only tags that carry a session or a benchmark label
    are counted: ``RequestTag.tracked``)."""

    def __init__(
        self,
        capacity: int = 20000,
        max_age_s: float = 3600.0,
        grace_s: float = TAG_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_age_s <= 0 or grace_s < 0:
            raise ValueError("max_age_s must be > 0 and grace_s ≥ 0")
        self.capacity = capacity
        self.max_age_s = max_age_s
        self.grace_s = grace_s
        self.clock = clock
        self._map: BoundedDict[str, _Pending] = BoundedDict(capacity)  # oldest first
        self._settled: BoundedDict[str, float] = BoundedDict(capacity)  # key → drop time, in order
        self._expired = 0  # tracked tags dropped unclaimed: past their grace or age, or the capacity
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            self._sweep()
            return len(self._map)

    @property
    def dropped(self) -> int:
        with self._lock:
            self._sweep()
            return self._expired

    def put(self, key: str, tag: RequestTag) -> None:
        """An HTTP exchange under ``key`` opens (again, when a client reuses an id)."""
        with self._lock:
            now = self.clock()
            self._sweep(now)
            self._settled.pop(key)
            entry = self._map.get(key)
            if entry is None:
                entry = _Pending(tag, now)
            else:
                entry.clash = entry.open > 0 and (entry.clash or entry.tag.owner != tag.owner)
                entry.tag, entry.since, entry.open = tag, now, entry.open + 1
            for _, lost in self._map.put(key, entry):
                self._expired += lost.tag.tracked

    def claim(self, *keys: str) -> RequestTag | None:
        """The tag of the first key present (callers try several spellings of an id); it
        stays for the other engine requests of the same HTTP request."""
        with self._lock:
            self._sweep()  # past its grace or age a tag is gone, whether or not anything swept since
            for key in keys:
                entry = self._map.get(key)
                if entry is not None:
                    if entry.clash:
                        return None
                    entry.claimed = True
                    return entry.tag
        return None

    def settle(self, key: str) -> None:
        """An HTTP exchange under ``key`` ended: once none is open, the tag goes ``grace_s`` later."""
        with self._lock:
            entry = self._map.get(key)
            if entry is None:
                return
            entry.open -= 1
            if entry.open <= 0 and key not in self._settled:
                self._settled.put(key, self.clock() + self.grace_s)

    def _sweep(self, now: float | None = None) -> None:
        """Drop settled tags past their grace and tags past the age limit (both stores are
        in time order, so this stops at the first entry still due)."""
        now = self.clock() if now is None else now
        while (due := self._settled.oldest()) is not None and due[1] <= now:
            self._settled.pop_oldest()
            entry = self._map.pop(due[0])
            self._expired += entry is not None and not entry.claimed and entry.tag.tracked
        while (old := self._map.oldest()) is not None and now - old[1].since > self.max_age_s:
            self._map.pop_oldest()
            self._settled.pop(old[0])
            self._expired += not old[1].claimed and old[1].tag.tracked
