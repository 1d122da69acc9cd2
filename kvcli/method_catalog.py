"""The compression methods' catalog: what the command line says of each method without importing
it (nor PyTorch, which the methods import; so it sits outside kvcli.compressors, whose package
imports every method): ``kvcli compressors`` (its docstring, paper, knobs with their defaults and meanings) and
``--kv-bits``'s help (the bits ``auto`` holds its KV in). The class states each fact (:func:`describe`
reads them off it); ``python -m kvcli.cli.reference`` copies them into kvcli/methods.json (data, in
:data:`kvcli.compressors.REGISTRY`'s order), and ``tests/test_docs.py`` fails when the copy is not
what the classes say. A new method is still its file: run the command, as for docs/methods.md's
table (:func:`methods` adds a method registered in this process that the copy lacks)."""

from __future__ import annotations

import json
import re
import sys
from functools import cache
from pathlib import Path
from typing import NamedTuple


class Knob(NamedTuple):
    name: str
    default: str  # as a spec writes it (kvcli.compressors.base.knob_text: auto, true, 0.25)
    help: str


class Method(NamedTuple):
    name: str
    doc: str  # the class docstring, its lines joined
    paper: str
    auto_kv_bits: int  # Compressor.auto_kv_bits
    knobs: tuple[Knob, ...]


def summary(method: Method) -> str:
    """A method's one line: the first sentence of its docstring after "Name (Authors, year): "."""
    doc = method.doc.replace("``", "")
    _, colon, rest = doc.partition("): ")
    first = re.split(r"(?<=\.)\s", rest if colon else doc, maxsplit=1)[0]
    return first[:1].upper() + first[1:]


def knob_text(value) -> str:
    """A knob's value as a spec writes it (None: auto; booleans: true/false)."""
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def describe(cls) -> Method:
    """What the command line says of the method class ``cls`` (a registered Compressor)."""
    knobs = tuple(Knob(f.name, knob_text(f.default), f.metadata.get("help", "")) for f in cls.knobs())
    return Method(cls.name, " ".join((cls.__doc__ or "").split()), cls.paper, cls.auto_kv_bits, knobs)


STORED = Path(__file__).with_name("methods.json")  # written by python -m kvcli.cli.reference


def as_data(methods: dict[str, Method]) -> str:
    """kvcli/methods.json's text for ``methods``."""
    data = {
        name: {"doc": m.doc, "paper": m.paper, "auto_kv_bits": m.auto_kv_bits, "knobs": [k._asdict() for k in m.knobs]}
        for name, m in methods.items()
    }
    return json.dumps(data, indent=1, ensure_ascii=False) + "\n"


@cache
def stored() -> dict[str, Method]:
    """The methods as kvcli/methods.json states them (read once)."""
    data = json.loads(STORED.read_text(encoding="utf-8"))
    return {
        name: Method(name, m["doc"], m["paper"], m["auto_kv_bits"], tuple(Knob(**k) for k in m["knobs"]))
        for name, m in data.items()
    }


def methods() -> dict[str, Method]:
    """Every method: the stored copy, and those registered in this process (a method defined at run
    time; a method's module already imported), read off their classes; nothing is imported here."""
    base = sys.modules.get("kvcli.compressors.base")
    registered = {} if base is None else {name: describe(cls) for name, cls in base.REGISTRY.items()}
    return {**stored(), **registered}
