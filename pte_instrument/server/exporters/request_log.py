"""The request log: opt-in JSONL, one object per finished request (README: field list)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from pte_instrument.server.ledger import RequestRecord


class RequestLogWriter:
    """Appends one JSON line per record. A write that fails raises (the caller counts it as
    an exporter fault); the next write tries to reopen the file, so a fixed disk recovers."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fh = None
        self._lock = threading.Lock()

    def _open(self):
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = self.path.open("a", encoding="utf-8")
        return self._fh

    def export(self, record: RequestRecord) -> None:
        line = json.dumps(record.to_dict(), separators=(",", ":"), allow_nan=False) + "\n"
        with self._lock:
            try:
                fh = self._open()
                fh.write(line)
                fh.flush()
            except OSError:
                self.close()
                raise

    def close(self) -> None:
        if self._fh is not None:
            try:
                self._fh.close()
            finally:
                self._fh = None
