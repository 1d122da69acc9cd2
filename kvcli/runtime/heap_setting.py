"""Whether freed memory stays in the process's heap for the next allocation
(:func:`kvcli.runtime.measure.keep_freed_memory`): ``$KVCLI_HEAP``, keep (the default) or system
(glibc's own settings, as before), checked. It imports no PyTorch, so ``kvcli --help`` lists the
variable at once."""

from __future__ import annotations

import os

ENV_HEAP = "KVCLI_HEAP"
HEAP_CHOICES = ("keep", "system")  # the first the default


def heap_kept() -> bool:
    """``$KVCLI_HEAP`` as a switch (unset: keep); another value than keep or system is a
    :class:`~kvcli.errors.UsageError` naming the variable."""
    value = os.environ.get(ENV_HEAP, "").strip().lower() or HEAP_CHOICES[0]
    if value not in HEAP_CHOICES:
        from ..errors import UsageError

        raise UsageError(f"{ENV_HEAP} must be {' or '.join(HEAP_CHOICES)}, not '{value}'")
    return value == HEAP_CHOICES[0]
