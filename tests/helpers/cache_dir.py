"""The test session's own cache folder: the models the user's cache already converted, linked read
only, so a test run neither converts them again nor writes into the user's cache."""

from __future__ import annotations

from pathlib import Path

from kvcli.model.embedded import _SOURCE_MARKER
from kvcli.model.kept import FACTS


def link_converted_models(source: Path, dest: Path) -> None:
    """``dest``: a new folder holding, for each complete conversion in ``source`` (a folder with its
    marker, not a half-written ``.tmp-`` one) and each folder of kept 8-bit weights, a folder of the same name whose files are symlinks
    to the originals. kvcli only reads a converted folder, and writes atomically (a new file
    renamed into place), so nothing done under ``dest`` changes ``source``."""
    dest.mkdir(parents=True)
    if not source.is_dir():
        return
    for folder in sorted(source.iterdir()):
        finished = (folder / _SOURCE_MARKER).is_file() or (folder / FACTS).is_file()  # a conversion, kept weights
        if folder.name.startswith(".") or not finished:
            continue
        for path in sorted(folder.rglob("*")):
            target = dest / folder.name / path.relative_to(folder)
            if path.is_dir():
                target.mkdir(parents=True, exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.symlink_to(path)
