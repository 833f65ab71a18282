"""The settings tables of README.md and docs/configuration.md, written from
``pte_instrument.settings.TABLE`` between their markers; ``--check``: exit 1 (naming the
file) where a table differs from the settings, and write nothing."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pte_instrument.settings import markdown_table

ROOT = Path(__file__).resolve().parents[1]
BEGIN = "<!-- settings table: generated from pte_instrument/settings.py by scripts/settings_tables.py -->"
END = "<!-- end of the settings table -->"
TABLES = {ROOT / "README.md": True, ROOT / "docs" / "configuration.md": False}  # path → README's form


def rewritten(text: str, table: str) -> str:
    head, begin, rest = text.partition(BEGIN + "\n")
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"no {BEGIN!r} … {END!r} markers")
    return head + begin + table + end + tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="only say which file differs")
    args = parser.parse_args(argv)
    stale = []
    for path, readme in TABLES.items():
        text = path.read_text(encoding="utf-8")
        new = rewritten(text, markdown_table(readme=readme))
        if new != text:
            stale.append(path.relative_to(ROOT))
            if not args.check:
                path.write_text(new, encoding="utf-8")
    for path in stale:
        print(f"{path}: {'differs from' if args.check else 'rewritten from'} pte_instrument/settings.py")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
