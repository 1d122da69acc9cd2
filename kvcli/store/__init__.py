"""The disk KV store: prefix states kept between runs (:mod:`.kvstore` says what and how safely).

What the rest of kvcli uses: :class:`KVStore` (``fetch``, the cache commands, ``watching`` with a
:class:`Watcher`), :func:`make_key`, :func:`fetch_book` (a book written while it is read, resumed
when a read stopped), the cap (:func:`resolve_cap`, :func:`parse_size`).
"""

from .book import fetch_book
from .capacity import CAP_ENV, NO_CAP, least_recently_used, parse_size, resolve_cap
from .entries import DamagedEntry, Entry
from .housekeeping import Leftovers
from .keys import FORMAT_VERSION, StoreKey, make_key
from .kvstore import Fetched, KVStore, Loaded, Watcher
from .locks import Holder, LocksUnsupported, take_lock

__all__ = [
    "CAP_ENV",
    "FORMAT_VERSION",
    "NO_CAP",
    "DamagedEntry",
    "Entry",
    "Fetched",
    "Holder",
    "KVStore",
    "Leftovers",
    "Loaded",
    "LocksUnsupported",
    "StoreKey",
    "Watcher",
    "fetch_book",
    "least_recently_used",
    "make_key",
    "parse_size",
    "resolve_cap",
    "take_lock",
]
