"""The tests' tables of the registered methods, read off each method's class (no hand-kept list):
a method defined anywhere — a test file included — is in them while it is registered.

``COMPRESSING``: name -> a spec that compresses the tests' short documents
(:attr:`~kvcli.compressors.base.Compressor.short_document_spec`); ``HOLDS_EVERYTHING``: the methods
that hold every prompt token's KV (``holds_every_token``); ``NOT_ON_HYBRIDS``: name -> why the method
refuses hybrid (sliding-window) models, in one line (``hybrid_refusal``, which its ``configure`` raises:
the contract test checks the refusal)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Set

from kvcli.compressors import REGISTRY


class _Compressing(Mapping):
    def __getitem__(self, name: str) -> str:
        cls = REGISTRY[name]
        if "short_document_spec" not in vars(cls):
            raise TypeError(f"{cls.__name__} ({name}) declares no short_document_spec (see Compressor)")
        return cls.short_document_spec

    def __iter__(self) -> Iterator[str]:
        return iter(list(REGISTRY))

    def __len__(self) -> int:
        return len(REGISTRY)


class _HoldsEverything(Set):
    @classmethod
    def _from_iterable(cls, names) -> frozenset:  # what `-`, `&`, `|` return
        return frozenset(names)

    def __contains__(self, name) -> bool:
        return name in REGISTRY and REGISTRY[name].holds_every_token

    def __iter__(self) -> Iterator[str]:
        return iter([name for name, cls in REGISTRY.items() if cls.holds_every_token])

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _NotOnHybrids(Mapping):
    def __getitem__(self, name: str) -> str:
        if name not in REGISTRY or not REGISTRY[name].hybrid_refusal:
            raise KeyError(name)
        return REGISTRY[name].hybrid_refusal

    def __iter__(self) -> Iterator[str]:
        return iter([name for name, cls in REGISTRY.items() if cls.hybrid_refusal])

    def __len__(self) -> int:
        return sum(1 for _ in self)


COMPRESSING: Mapping[str, str] = _Compressing()
HOLDS_EVERYTHING: Set[str] = _HoldsEverything()
NOT_ON_HYBRIDS: Mapping[str, str] = _NotOnHybrids()
