"""Compression methods, one per file: a method's class registers itself by its name when its module
is imported (see :mod:`.base`), and importing this package imports every method's module. A method
is one policy file here (its knobs, its paper, its hooks; ``keep_all`` for the contract test) plus,
only if it needs a new cache layout, one file in :mod:`kvcli.caches`; per-model calibration sits
beside its method (``razor_heads.py``)."""

# the import order is the order of docs/methods.md's table (`kvcli compressors` lists them by name)
# isort: off
from .base import REGISTRY, Compressor, describe_knobs, owned_phases, parse_one, register

# --- the baseline, then token selection
from . import full, gemfilter, pages  # noqa: F401  (each registers its method)

# --- KV eviction after the prefill (kvcli.compressors.scoring), prefill- and decoding-owning methods
from . import snapkv, pyramidkv, h2o, streamingllm, razor, finch, lazyllm, blocksparse, infllm  # noqa: F401

# --- more eviction, the compressed prefix, decoding-time compression
from . import tova, knorm, keydiff, adakv, expected_attention, kvzip, duo, decoding  # noqa: F401
# isort: on

__all__ = ["REGISTRY", "Compressor", "describe_knobs", "owned_phases", "parse_one", "register"]
