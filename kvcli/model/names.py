"""The names of the loading choices, without PyTorch (the command line's help reads them):
:data:`QUANTS` as :func:`kvcli.model.load_model` takes them, as the user spells them, and the
attention kernels. :mod:`.facts` re-exports them beside the dtypes."""

from __future__ import annotations

# the model used where none is named (-m's default; the library's too: kvcli.model.catalog.default_model)
MODEL_ENV = "KVCLI_MODEL"

QUANTS = ("auto", "none", "4bit", "8bit")

# the user's spelling of each (``--quant 8``, as ``--kv-bits 8`` names bits; ``--json``'s ``quant``)
QUANT_SPELLINGS = {"auto": "auto", "none": "none", "8": "8bit", "4": "4bit"}


def spelled(quant: str) -> str:
    """``quant`` (a name of :data:`QUANTS`) as the user spells it: ``8bit`` -> ``8``."""
    return next(user for user, name in QUANT_SPELLINGS.items() if name == quant)


def quant_name(value: str | int) -> str | None:
    """The name :func:`kvcli.model.load_model` takes (a name of :data:`QUANTS`) for ``value``
    spelled as ``--quant``, ``AskOptions.quant`` and ``--json`` spell it (``8`` -> ``8bit``);
    None when it is not one of those spellings."""
    return QUANT_SPELLINGS.get(str(value).strip().lower())


ATTNS = ("sdpa", "eager", "flash")
