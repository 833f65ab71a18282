"""Output folders written whole or not at all.

A command that writes several files into one folder (``pte validate --out``, ``--plots``)
writes them first into a hidden folder inside it, and moves them into place only once every
one is written: a failure half-way (a full disk, a file size limit, a folder where a file
must go) leaves the folder as it was, with no mix of new and old files. Renames within one
folder need no space, so a full disk fails while writing, before anything is replaced.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from pte_instrument.cli.errors import UsageError


def check_folder(target: str | Path, flag: str) -> None:
    """Refuse, before any work, an output folder that is a file (or lies under one)."""
    p = Path(target)
    for q in (p, *p.parents):
        if q.exists():
            if not q.is_dir():
                raise UsageError(
                    f"{flag} {target}: "
                    + ("a file, not a folder" if q == p else f"{q} is a file, not a folder")
                )
            return


@contextmanager
def staged_folder(target: str | Path, flag: str, inputs: Sequence[str | Path] = ()) -> Iterator[Path]:
    """An empty hidden folder inside ``target`` (made, with its parents, if need be) for the
    block to write its files into. When the block ends without an error, each file is moved
    into ``target`` under its own name, replacing a file of that name; when it fails, or a
    file cannot go into place (a folder of its name is there, or it would replace one of
    ``inputs``), nothing is moved: the error is raised (a :class:`UsageError` for the last
    two) and ``target`` holds what it held, a folder this made removed again."""
    out = Path(target)
    check_folder(out, flag)
    missing = [q for q in (out, *out.parents) if not q.exists()]
    staging: Path | None = None
    try:
        out.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".pte-", suffix=".tmp", dir=out))
        yield staging
        names = sorted(os.listdir(staging))
        for name in names:
            dest = out / name
            if dest.is_dir():
                raise UsageError(f"{flag} {out}: {dest} is a folder, where the file {name} must go")
            for src in inputs:
                if dest.exists() and dest.samefile(src):
                    raise UsageError(f"{flag} {out} would write {name} over {src}, an input it reads")
        for name in names:
            os.replace(staging / name, out / name)
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
            staging = None
        for q in missing:  # deepest first: the folders this made, if still empty
            try:
                q.rmdir()
            except OSError:
                break
        raise
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
