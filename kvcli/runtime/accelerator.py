"""Whether a device is an accelerator: the one question behind every choice kvcli makes by device
(a lower-right causal bias instead of a boolean mask, the MLP run chunk by chunk, H2O's block rows,
the store's memo kept on the host, a fresh prefix handed over instead of copied).

One function, read through this module (``accelerator.on_accelerator(device)``), so that the
simulated accelerator's fidelity test (tests/bench/test_simulate_fidelity.py) can run the ``meta``
device with the CPU's choices and compare its allocations with a real CPU run's."""

from __future__ import annotations

import torch


def on_accelerator(device) -> bool:
    """True for any device but the CPU (CUDA, and the simulator's ``meta``)."""
    return device is not None and torch.device(device).type != "cpu"
