"""The choices shared by every command line that loads a model (``kvcli ask``, ``inspect``,
``heads``, ``bench``), as enums Typer turns into ``--device auto|cpu|cuda`` and so on."""

from __future__ import annotations

from enum import Enum


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Quant(str, Enum):
    none = "none"
    four = "4bit"
    eight = "8bit"


class Offload(str, Enum):
    none = "none"
    cpu = "cpu"


class Attn(str, Enum):
    sdpa = "sdpa"
    eager = "eager"
    flash = "flash"
