"""Every cache layout kvcli runs on, one file each; importing this package registers every kind
with the disk store (:data:`CACHE_TYPES`). See :mod:`kvcli.caches.base` for the contract."""

from ..runtime.attention import LayerView
from .base import CACHE_TYPES, CacheBase, LayerKV, cache_type
from .blocks import BlockCache, BlockLayer, OffloadKVCache, ScoredKVCache
from .book import BookCache, BookLayer
from .kv import KVCache
from .lazy import LazyCache
from .qkv import QuantKVCache, QuantLayer
from .ragged import RaggedCache, RaggedLayer
from .razor import RazorCache, RazorLayer, compensated_attention

__all__ = [
    "CACHE_TYPES",
    "CacheBase",
    "LayerKV",
    "LayerView",
    "cache_type",
    "KVCache",
    "RazorCache",
    "RazorLayer",
    "compensated_attention",
    "RaggedCache",
    "RaggedLayer",
    "BlockCache",
    "BlockLayer",
    "OffloadKVCache",
    "ScoredKVCache",
    "LazyCache",
    "QuantKVCache",
    "QuantLayer",
    "BookCache",
    "BookLayer",
]
