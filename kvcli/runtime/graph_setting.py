"""Whether decoding may capture its step as a CUDA graph (:mod:`kvcli.runtime.graphs`):
``$KVCLI_CUDA_GRAPHS``, 1 (the default) or 0 (step by step, each kernel launched from the host, as
before), checked. It imports no PyTorch, so ``kvcli --help`` lists the variable at once."""

from __future__ import annotations

import os

ENV_CUDA_GRAPHS = "KVCLI_CUDA_GRAPHS"


def graphs_allowed() -> bool:
    """``$KVCLI_CUDA_GRAPHS`` as a switch (unset: on); another value than 0 or 1 is a
    :class:`~kvcli.errors.UsageError` naming the variable."""
    env = os.environ.get(ENV_CUDA_GRAPHS, "").strip()
    if env in ("", "1"):
        return True
    if env == "0":
        return False
    from ..errors import UsageError

    raise UsageError(
        f"{ENV_CUDA_GRAPHS} must be 1 (decoding steps captured as CUDA graphs, the default) or 0, not '{env}'"
    )
