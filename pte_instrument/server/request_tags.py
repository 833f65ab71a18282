"""Request tags: validating client-supplied session ids, and remembering which session and
benchmark label a request carries until the server reports it finished. Both bounded."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from pte_instrument.server.bounded import BoundedDict

MAX_SESSION_ID_LEN = 128


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


class PendingTags:
    """request key → tag, for requests not yet finished. Least recently added entries are
    dropped past ``capacity`` (requests that never reach the engine)."""

    def __init__(self, capacity: int = 20000) -> None:
        self.capacity = capacity
        self._map: BoundedDict[str, RequestTag] = BoundedDict(capacity)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._map)

    @property
    def dropped(self) -> int:
        return self._map.dropped

    def put(self, key: str, tag: RequestTag) -> None:
        with self._lock:
            self._map.put(key, tag)

    def pop(self, *keys: str) -> RequestTag | None:
        """The tag of the first key present (callers try several spellings of an id)."""
        with self._lock:
            for key in keys:
                tag = self._map.pop(key, None)
                if tag is not None:
                    return tag
        return None
