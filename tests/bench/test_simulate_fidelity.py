"""The simulation follows the real path: the same tracker over a real CPU run of a tiny random
llama and over the meta run of the same model, through kvcli's own session, pipeline, engine and
caches, sees the same allocations in the same order and the same peak.

Both runs make the CPU's choices (kvcli.runtime.accelerator.on_accelerator is False for meta here: a
boolean mask for a query block on a longer KV, no chunked MLP, ...; the accelerator's choices are
checked in tests/test_masks.py and tests/test_decode_syncs.py) and force SDPA's math path (the same decomposition on every device; the CUDA backend model
is checked in test_simulate_tracker). The comparison counts host and device tensors together and
leaves out what only crosses devices in the meta run (the host->device copies a one-device CPU
run does not make, and the answers to device->host reads)."""

from __future__ import annotations

import pytest
import torch

from kvcli.bench.simulate.run import open_loaded, simulate
from kvcli.bench.simulate.tracker import cuda_block
from tests.helpers.tiny_models import tiny_config


def _model(device: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


def _trace(tracker):
    """(allocation sizes in order, peak of live bytes) over host and device, without transfers."""
    sizes, live, peak = [], 0, 0
    for sign, alloc in tracker.events:
        if alloc.op.startswith(("h2d", "d2h")):
            continue
        if sign > 0:
            sizes.append(alloc.nbytes)
        live += sign * cuda_block(alloc.nbytes)
        peak = max(peak, live)
    return sizes, peak


@pytest.mark.parametrize("method", ["full", "snapkv:budget=64"])
def test_meta_run_allocates_as_the_real_cpu_run(method, monkeypatch):
    from kvcli.runtime import accelerator

    monkeypatch.setattr(accelerator, "on_accelerator", lambda device: False)
    runs = {}
    for device in ("cpu", "meta"):
        # 16-bit KV (the simulator's default is auto: 8 bits for both methods): at 8 bits the CPU takes
        # kernels of its own (kvcli.caches.quant: int8 products, a scratch buffer kept across calls),
        # chosen by the tensors' device type, that a GPU never runs and the meta run does not either
        sim = open_loaded(_model(device), "tiny-llama", "fp32", "tiny-llama", kv_bits=16)
        row = simulate(sim, method, 300, steps=4, sdpa="math")
        assert row["error"] is None, row["error"]
        runs[device] = (row, _trace(sim.engine.tracker))
    (cpu_row, (cpu_sizes, cpu_peak)), (meta_row, (meta_sizes, meta_peak)) = runs["cpu"], runs["meta"]
    assert len(cpu_sizes) > 100
    assert meta_sizes == cpu_sizes
    assert meta_peak == cpu_peak
    assert meta_row["kv_bytes"] == cpu_row["kv_bytes"] > 0
    # the meta run also saw what a GPU would cross: the token read once per step, and no host->device
    # copy (the step takes the last token where it is, on the device)
    assert meta_row["syncs_per_decode_step"] == 1 and cpu_row["syncs_per_decode_step"] == 0
    assert meta_row["h2d_copies_per_decode_step"] == 0 == cpu_row["h2d_copies_per_decode_step"]
