"""Compression methods, one per file: a method's class registers itself by its name when its module
is imported (see :mod:`.base`), and importing this package imports every method's module. A method
is one policy file here (its knobs, its paper, its hooks; ``keep_all`` for the contract test) plus,
only if it needs a new cache layout, one file in :mod:`kvcli.caches`; per-model calibration sits
beside its method (``razor_heads.py``)."""

# the import order is the order `kvcli compressors` lists the methods in
# isort: off
from .base import REGISTRY, Compressor, describe_knobs, owned_phases, parse_one, register

# --- token selection and prefill-owning methods
from . import full, finch, gemfilter, pages, lazyllm, razor, blocksparse, duo, infllm  # noqa: F401  (each registers its method)

# --- KV eviction after the prefill (kvcli.compressors.scoring)
from . import snapkv, pyramidkv, h2o, streamingllm, tova, knorm, keydiff, adakv, expected_attention, kvzip  # noqa: F401

# --- decoding-time compression
from . import decoding  # noqa: F401  (each registers its method)
# isort: on

__all__ = ["REGISTRY", "Compressor", "describe_knobs", "owned_phases", "parse_one", "register"]
