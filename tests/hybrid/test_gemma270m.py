"""The second embedded model, Gemma 3 270M (slow: converted once into the cache, ~1-2 min, then
~1 s to load): kvcli's layer-by-layer full attention reproduces transformers' own logits, its
sliding layers hold their window while decoding, and its GGUF passed as a path is the same model."""

from __future__ import annotations

import pytest
import torch

from kvcli.errors import ModelError
from kvcli.model import catalog, load_model
from tests.helpers.embedded import logits_both_ways

pytestmark = pytest.mark.slow


def test_gemma3_270m_facts_and_logits_match_transformers(gemma):
    lm = gemma
    assert lm.family == "gemma3_text" and lm.n_layers == 18 and lm.max_context == 32768
    assert lm.windows.full_layers == [5, 11, 17] and {lm.windows.window(i) for i in range(18)} == {512, None}
    ids, engine, got, ref = logits_both_ways(lm, 700, 200000)  # longer than the 512-token window
    assert (got - ref).abs().max() < 2e-3 * ref.abs().max()
    assert torch.equal(got[-50:].argmax(-1), ref[-50:].argmax(-1))
    # decoding: the sliding layers keep their window, the logits stay transformers'
    cache, logits = engine.prefill(ids[:650])
    cache.trim_windows(engine.windows)
    assert cache.seq_len(0) == 511 and cache.seq_len(5) == 650
    for i in range(650, 700):
        logits = engine.step(int(ids[i]), i, cache)
        assert (logits - ref[i]).abs().max() < 2e-3 * ref[i].abs().max()


def test_the_gemma_gguf_as_a_path_is_the_embedded_model(gemma, tmp_path):
    path = catalog.assemble(catalog.GEMMA, tmp_path)
    by_path = load_model(str(path), dtype="float32")
    assert by_path.source == gemma.source and by_path.fingerprint == gemma.fingerprint


def test_damaged_chunks_are_assembled_twice_then_one_line(tmp_path):
    chunks = [tmp_path / f"c{i}" for i in range(2)]
    for c in chunks:
        c.write_bytes(b"not gemma")
    with pytest.raises(ModelError, match="assembled twice.*pip install --force-reinstall") as info:
        catalog.assemble(catalog.GEMMA, tmp_path, chunks)
    assert "\n" not in str(info.value) and not (tmp_path / catalog.GEMMA.gguf_file).exists()
