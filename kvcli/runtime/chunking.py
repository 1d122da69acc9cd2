"""The prefill chunk a user asks for: ``$KVCLI_PREFILL_CHUNK``, tokens a prefill pass reads at a
time (0: one pass), checked. It imports no PyTorch, so ``kvcli --help`` lists the variable at once;
:func:`kvcli.runtime.prefill.default_prefill_chunk` falls back on the device's default when it is
not set."""

from __future__ import annotations

import os

ENV_PREFILL_CHUNK = "KVCLI_PREFILL_CHUNK"


def requested_chunk() -> int | None:
    """``$KVCLI_PREFILL_CHUNK`` as tokens (0 for one pass), or None when it is not set; a value
    that is not a whole number is a :class:`~kvcli.errors.UsageError` naming the variable."""
    env = os.environ.get(ENV_PREFILL_CHUNK, "").strip()
    if not env:
        return None
    try:
        return int(env)
    except ValueError:
        from ..errors import UsageError

        raise UsageError(f"{ENV_PREFILL_CHUNK} must be a whole number of tokens (0: off), not '{env}'") from None
