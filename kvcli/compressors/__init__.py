"""Compression methods, one per file, registered by name (see :mod:`.base`): importing this
package registers every method. A method is one policy file here (its knobs, its paper, its
hooks; ``keep_all`` for the contract test) plus, only if it needs a new cache layout, one file in
:mod:`kvcli.caches`; per-model calibration sits beside its method (``razor_heads.py``)."""

# the registration order is the order `kvcli compressors` lists the methods in
# isort: off
from .base import REGISTRY, Compressor, describe_knobs, owned_phases, parse_one, register

# --- token selection and prefill-owning methods
from .full import FullAttention
from .finch import Finch
from .gemfilter import GemFilter
from .pages import Pages
from .lazyllm import LazyLLM
from .razor import Razor
from .blocksparse import BlockSparse
from .duo import DuoAttention
from .infllm import InfLLM

# --- KV eviction after the prefill (kvcli.compressors.scoring)
from .snapkv import SnapKV
from .pyramidkv import PyramidKV
from .h2o import H2O
from .streamingllm import StreamingLLM
from .tova import TOVA
from .knorm import KNorm
from .keydiff import KeyDiff
from .adakv import AdaKV
from .expected_attention import ExpectedAttention
from .kvzip import KVzip

# --- decoding-time compression
from .decoding import Decoding
# isort: on

__all__ = [
    "REGISTRY",
    "Compressor",
    "describe_knobs",
    "owned_phases",
    "parse_one",
    "register",
    "FullAttention",
    "Finch",
    "GemFilter",
    "Pages",
    "LazyLLM",
    "Razor",
    "BlockSparse",
    "DuoAttention",
    "InfLLM",
    "SnapKV",
    "PyramidKV",
    "H2O",
    "StreamingLLM",
    "TOVA",
    "KNorm",
    "KeyDiff",
    "AdaKV",
    "ExpectedAttention",
    "KVzip",
    "Decoding",
]
