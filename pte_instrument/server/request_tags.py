"""Request tags: validating client-supplied session ids, and remembering which session,
benchmark label, tenant and requested model a request carries until the server reports it
finished. Both bounded."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pte_instrument.server.bounded import BoundedDict

MAX_SESSION_ID_LEN = 128
MAX_ECHO_LEN = 128


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


@dataclass(frozen=True)
class RequestTag:
    session_id: str | None
    benchmark: str  # an allow-listed label, "other", or "none"
    tenant: str | None = None  # an allow-listed tenant or "other"; None: tenants are off
    model: str | None = None  # the OpenAI "model" field (read when the server serves LoRA adapters)


@dataclass
class _Pending:
    tag: RequestTag
    since: float
    open: int = 1  # HTTP exchanges under this key still going (clients may reuse an id)
    claimed: bool = False


class PendingTags:
    """request key → tag, for requests not yet finished.

    One HTTP request can become several engine requests (``n > 1``, a list of prompts), so
    a tag is claimed without being removed (``claim``). It stays while its HTTP exchange
    is open and ``grace_s`` after it ends (``settle``): the stat logger sees a request
    finish before, or moments after, its answer goes out. A client that reuses a request id
    opens the key again. Past ``max_age_s``, or past ``capacity`` (least recently added
    first), a tag goes in any case. ``dropped`` counts the tags that went unclaimed: their
    requests never reached the engine."""

    def __init__(
        self,
        capacity: int = 20000,
        max_age_s: float = 3600.0,
        grace_s: float = 5.0,
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
        self._expired = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            self._sweep()
            return len(self._map)

    @property
    def dropped(self) -> int:
        with self._lock:
            self._sweep()
            return self._map.dropped + self._expired

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
                entry.tag, entry.since, entry.open = tag, now, entry.open + 1
            self._map.put(key, entry)

    def claim(self, *keys: str) -> RequestTag | None:
        """The tag of the first key present (callers try several spellings of an id); it
        stays for the other engine requests of the same HTTP request."""
        with self._lock:
            self._sweep()  # past its grace or age a tag is gone, whether or not anything swept since
            for key in keys:
                entry = self._map.get(key)
                if entry is not None:
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
            self._expired += entry is not None and not entry.claimed
        while (old := self._map.oldest()) is not None and now - old[1].since > self.max_age_s:
            self._map.pop_oldest()
            self._settled.pop(old[0])
            self._expired += not old[1].claimed
