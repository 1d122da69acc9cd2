"""The disk KV store: prefix states kept between runs (:mod:`.kvstore` says what and how safely).

What the rest of kvcli uses: :class:`KVStore` (``fetch``, the cache commands, ``watching`` with a
:class:`Watcher`), :func:`make_key`, :func:`fetch_book` (a book written while it is read, resumed
when a read stopped), the cap (:func:`resolve_cap`, :func:`parse_size`).
"""

from .. import lazy

# where each name lives: imported on first use (PEP 562), so the command line's help, which reads
# the cap's variable, imports no PyTorch through this package
_WHERE = {
    "fetch_book": ".book",
    "CAP_ENV": ".capacity",
    "NO_CAP": ".capacity",
    "least_recently_used": ".capacity",
    "parse_size": ".capacity",
    "resolve_cap": ".capacity",
    "DamagedEntry": ".entries",
    "Entry": ".entries",
    "Leftovers": ".housekeeping",
    "FORMAT_VERSION": ".keys",
    "StoreKey": ".keys",
    "make_key": ".keys",
    "Fetched": ".kvstore",
    "KVStore": ".kvstore",
    "Loaded": ".kvstore",
    "Watcher": ".kvstore",
    "Holder": ".locks",
    "LocksUnsupported": ".locks",
    "take_lock": ".locks",
}


__getattr__ = lazy.attributes(__name__, _WHERE)

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
