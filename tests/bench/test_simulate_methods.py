"""Every registered method through the meta-device simulator on Llama-3.1-8B's shape in nf4, 8 of its
layers (what ``kvcli bench memory --simulate --methods all`` runs at 32k, here at a length and a
depth that keep CI short), each at the bits ``kvcli ask`` holds it in (``--kv-bits auto``, the
simulator's default too): no op mixes a host tensor into a device op as CUDA refuses (the
tracker's device rule), no method holds more KV than it states, and no allocation grows with the
number of passes (a table rebuilt larger at each pass: BookCache's RoPE table doubled at every
device switch, issue 50)."""

from __future__ import annotations

import re

import pytest

from kvcli.answer.pipeline import Pipeline
from kvcli.bench.simulate.report import bits_of
from kvcli.compressors import REGISTRY, parse_one
from tests.helpers.specs import COMPRESSING, HOLDS_EVERYTHING

TOKENS, STEPS = 256, 3

# the tests' compressing specs, two made lighter for the 8B shape at 256 tokens (every op of the
# simulation is a Python call: ~3 s a method): InfLLM reads in chunks of 64 (four passes: its RoPE
# table still meets the host and the device in every one), RazorAttention's head probe has 32
# random tokens (its default for an 8B model, 2,500 repeated four times, is a 10,000-token pass)
SPECS = {
    **COMPRESSING,
    "infllm": COMPRESSING["infllm"].replace("chunk=16", "chunk=64"),
    "razor": COMPRESSING["razor"] + ",tokens=32",
}
BUDGET = re.compile(r"\b(?:budget|target|k)=([\d.]+)")


# Llama-3.1-8B's layers, fewer of them: every decoder layer runs the same ops on the same shapes, and
# each method's per-layer choices (GemFilter's layer 1, PyramidKV's budgets, LazyLLM's stages) are
# still several layers apart. 8, not fewer: InfLLM's book (per layer) must outweigh the reading's
# host transients (per pass) for its check below to tell a mapped book from one in host memory
# (4 layers: a 2.6 MB book, a 2.7 MB host peak)
LAYERS = 8


def _session(kv_bits: int | str = "auto"):
    from kvcli.bench.simulate.models import CONFIGS, build_model
    from kvcli.bench.simulate.run import open_loaded

    model = build_model("llama-3.1-8b", "nf4", layers=LAYERS)
    return open_loaded(model, "llama-3.1-8b", "nf4", CONFIGS["llama-3.1-8b"][0], kv_bits=kv_bits)


@pytest.fixture(scope="module")
def rows():
    from kvcli.bench.simulate.run import simulate

    sim = _session()  # --kv-bits auto, as kvcli ask: 8 or 16 bits by method
    out = {}
    for name in sorted(REGISTRY):  # every registered method, with the tests' compressing spec
        row = simulate(sim, SPECS[name], TOKENS, steps=STEPS)
        out[name] = (row, sim.engine.tracker)
    return out


@pytest.fixture(scope="module")
def full_rows(rows):
    """Full attention's row at each precision the methods hold (bits -> row): the reference of
    each method's KV."""
    from kvcli.bench.simulate.run import simulate

    out = {bits_of(rows["full"][0]): rows["full"][0]}
    for bits in {bits_of(row) for row, _ in rows.values()} - set(out):
        out[bits] = simulate(_session(bits), "full", TOKENS, steps=STEPS)
    return out


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_method_runs_in_the_simulator_within_its_budget(rows, full_rows, name):
    row, tracker = rows[name]
    assert row["error"] is None, row["error"]  # a device mix raises in the tracker; so does a host runaway
    assert bits_of(row) == Pipeline.parse(SPECS[name]).kv_bits("auto")  # the row says the bits it held
    full = full_rows[bits_of(row)]  # full attention in the same bits
    per_token = full["kv_bytes"] / TOKENS  # the model's KV per token (full attention holds the prompt's)
    # a method that holds everything (blocksparse, infllm) holds full attention's KV and its blocks'
    # representatives besides: repr_topk keys (blocksparse: one) for every block_size
    extra = 0.0
    if name in HOLDS_EVERYTHING - {"full"}:
        method = parse_one(SPECS[name])
        extra = getattr(method, "repr_topk", 1) / method.block_size
    assert row["kv_bytes"] <= full["kv_bytes"] * (1.01 + extra), "more KV than full attention"
    stated = BUDGET.search(SPECS[name].split("+")[-1])
    if stated:  # a budget of tokens (or a share of the prompt): the KV held is within it
        b = float(stated.group(1))
        tokens = b * row["n_prompt_tokens"] if b < 1 else b
        room = 1.1 * tokens + 64  # rounding per head and layer, the question kept, the buffers' spare room
        assert row["kv_bytes"] <= room * per_token, (row["kv_bytes"] / per_token, tokens)
    # what a decoding step allocates does not grow with the steps before it
    largest = [
        max((a.nbytes for a in tracker.allocations if a.phase == f"decode:{j}"), default=0) for j in range(STEPS - 1)
    ]
    assert largest[-1] <= 1.25 * largest[0] + 64 * 1024, largest
    # the book of -c infllm is host memory; in the simulation a mapped file, counted
    if name == "infllm":
        assert row["book_host_bytes"] >= 0.9 * full["kv_bytes"] and row["host_peak_bytes"] < row["book_host_bytes"]
