"""Small helpers shared by the tests."""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import gc
import importlib.util
import json
import multiprocessing
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

T = TypeVar("T")


def wait(predicate: Callable[[], bool], timeout_s: float = 20.0, interval_s: float = 0.2) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True


def jsonl(path: Path) -> list[dict]:
    """The objects of a JSONL log a server is writing, one a line; none while the file does
    not exist yet. A last line without its newline is a record still being appended (a
    reader can see part of a write): left out until it is whole."""
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(x) for x in text[: text.rfind("\n") + 1].splitlines()]


def load_script(path: Path) -> ModuleType:
    """A script outside any package (scripts/*.py) loaded as the module ``path.stem``, and
    registered in sys.modules as an import would (dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def fill(directory: Path) -> Path:
    """Fill the filesystem holding ``directory``; returns the filler file."""
    filler = directory / "filler"
    with filler.open("wb", buffering=0) as f:
        while True:
            try:
                f.write(b"\0" * 512)
            except OSError as e:
                assert e.errno == errno.ENOSPC
                return filler


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """torch's CUDA sync debug mode "error" for the block: any call that makes the host wait
    for the GPU raises. The GPU is synchronised first, so work queued before cannot trip it."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def in_fresh_process(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a fresh interpreter (``fn`` importable, its result picklable). What it
    measures of the whole heap is then what the code under test keeps, and not also what
    the test process's other threads allocate meanwhile: a receiver that takes a session-long
    server's periodic exports grew a worker's heap by 4 MiB during one such test."""
    context = multiprocessing.get_context("forkserver")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(fn, *args).result()


def heap_now() -> int:
    """Bytes traced as allocated (``tracemalloc``), after a full collection: it also empties
    the interpreter's free lists, which hold what was freed last, not what is kept."""
    gc.collect()
    return tracemalloc.get_traced_memory()[0]
