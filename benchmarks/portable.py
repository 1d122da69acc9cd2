"""Paths in the benchmarks' JSON that say nothing of the machine that ran them.

A result committed under docs/bench names its files repository-relative (``kvcli``,
``benchmarks/out/kvcli-ddadf04/kvcli``) and a file outside the repository by its name alone under
a neutral placeholder (``<tmp>/book.txt``, ``<home>/R-intro.pdf``): never ``/tmp/tmpd6ppuwje/...``
or ``/home/someone/...`` (tests/test_docs.py checks every file there). Other absolute paths
(``/usr/sbin/sendmail`` quoted from a manual) are the same on every machine and stay.

The benchmark scripts write their paths through :func:`portable` (one path) and :func:`scrub` (a
command line, free text). ``python benchmarks/portable.py [--root DIR]... FILE...`` rewrites files
already written, in place and only in their paths (``--root``: another checkout whose paths are
repository-relative too, e.g. the one that ran them).
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository
# an absolute path in free text: a "/" at the start or after a space, a quote, "=", "(" or a
# backquote, up to the next space, quote, backquote, comma, semicolon or ")"
ABSOLUTE = re.compile(r"(?:(?<=^)|(?<=[\s\"'=(`]))/[^\s\"'`,;)]+")


def _inside(path: str, folder: str) -> str | None:
    """``path`` relative to ``folder`` ("." for the folder itself), None when it is not inside it."""
    folder = folder.rstrip("/")
    if path == folder:
        return "."
    return path[len(folder) + 1 :] if path.startswith(folder + "/") else None


def portable(path, roots: tuple[str, ...] = ()) -> str:
    """``path`` as a committed result names it: unchanged when relative; repository-relative when
    inside this checkout (or one of ``roots``); ``<tmp>/NAME`` in the temporary folder and
    ``<home>/NAME`` in a home folder, NAME its last part; any other path unchanged."""
    text = str(path)
    if not text.startswith("/"):
        return text
    text = os.path.normpath(text)
    for root in (str(ROOT), *roots):
        inside = _inside(text, os.path.normpath(root))
        if inside is not None:
            return inside
    name = Path(text).name
    for folder, placeholder in (
        (tempfile.gettempdir(), "<tmp>"),
        ("/tmp", "<tmp>"),
        (str(Path.home()), "<home>"),
        ("/home", "<home>"),
        ("/root", "<home>"),
    ):
        if _inside(text, os.path.normpath(folder)) is not None:
            return f"{placeholder}/{name}" if name else placeholder
    return text  # /usr/bin/..., /etc/...: the same on every machine (and a document may quote one)


def scrub(text: str, roots: tuple[str, ...] = ()) -> str:
    """``text`` (a command line, a message) with every absolute path in it made :func:`portable`."""
    return ABSOLUTE.sub(lambda m: portable(m.group(0), roots), text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--root", action="append", default=[], help="another checkout (its paths made relative)")
    args = parser.parse_args()
    for path in args.files:
        before = path.read_text(encoding="utf-8")
        after = scrub(before, tuple(args.root))
        if after != before:
            path.write_text(after, encoding="utf-8")
            print(f"rewrote {path}")


if __name__ == "__main__":
    main()
