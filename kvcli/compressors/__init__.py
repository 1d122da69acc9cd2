"""Compression methods, one per file, registered by name (see :mod:`.base`)."""

from .base import REGISTRY, Compressor, describe_knobs, owned_phases, parse_one, register
from .full import FullAttention
from .finch import Finch
from .gemfilter import GemFilter
from .lazyllm import LazyLLM
from .razor import Razor
from .blocksparse import BlockSparse
# --- KV eviction (kvcli.compressors.scoring) ---
from .snapkv import SnapKV
from .pyramidkv import PyramidKV
from .h2o import H2O
from .streamingllm import StreamingLLM
# ---

__all__ = [
    "REGISTRY",
    "Compressor",
    "Finch",
    "FullAttention",
    "GemFilter",
    "Razor",
    "describe_knobs",
    "owned_phases",
    "parse_one",
    "register",
]
# --- issue 16: more eviction scorers, head-adaptive budgets, question-agnostic compression ---
from .tova import TOVA
from .knorm import KNorm
from .keydiff import KeyDiff
from .adakv import AdaKV
from .expected_attention import ExpectedAttention
from .kvzip import KVzip
from .duo import DuoAttention
from .decoding import Decoding
