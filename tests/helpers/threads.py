"""One intra-op thread for modules that run many tiny models: their operations are far too small
to share, and on a loaded machine every parallel region waits for a second thread to be scheduled
(10x slower). Import ``one_thread`` into a test module to apply it there (autouse, per module)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
