"""Compression methods, one per file, registered by name (see :mod:`.base`)."""

from .base import REGISTRY, Compressor, describe_knobs, owned_phases, parse_one, register
from .full import FullAttention
from .gemfilter import GemFilter

__all__ = [
    "REGISTRY",
    "Compressor",
    "FullAttention",
    "GemFilter",
    "describe_knobs",
    "owned_phases",
    "parse_one",
    "register",
]
