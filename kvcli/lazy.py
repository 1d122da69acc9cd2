"""A package's names imported on first use (PEP 562): ``__getattr__ = lazy.attributes(__name__,
{"name": ".module", ...})`` in its ``__init__``, so importing the package for one light name (the
command line's help) does not import its heavy modules (PyTorch) with it."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def attributes(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: each name of ``where`` from its module (relative
    to the package), imported when the name is first asked for."""

    def __getattr__(name: str) -> Any:
        if name in where:
            return getattr(importlib.import_module(where[name], package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
