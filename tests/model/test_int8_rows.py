"""kvcli's int8 decoding kernel (kvcli/model/int8_rows.cpp): its product against an independent
float64 computation on each path this CPU has, and how a model load picks it up or leaves it."""

from __future__ import annotations

import pytest
import torch

from kvcli.errors import UsageError
from kvcli.model import int8_rows, load_model
from kvcli.model.cpu_quant import Int8Linear, quantize_int8


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """The kernel's path on this CPU, asked for (``KVCLI_INT8_KERNEL=kvcli``) for the module and
    compiled once; skipped where it cannot be."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(int8_rows.ENV, "kvcli")
        path = int8_rows.load(tmp_path_factory.mktemp("kernels"))
        if path is None:
            pytest.skip("kvcli's int8 kernel does not load here (no C++ compiler, or neither AVX2 nor AVX-512 VNNI)")
        yield path


def reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The activations quantised per row and block of 64 (largest magnitude at 127, half to even),
    each block's dot product with the int8 rows in float64, times the row's scale."""
    m, k = x.shape
    blocks = x.float().view(m, k // int8_rows.BLOCK, int8_rows.BLOCK)
    s = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    q = torch.round(blocks * inv).clamp(-127, 127)
    return (q.double() * s.double()).view(m, k) @ w.double().t() * scale.float().double()


def cases():
    gen = torch.Generator().manual_seed(0)
    for m, k, n in [(1, 64, 1), (1, 1536, 37), (3, 192, 8), (7, 128, 6), (8, 576, 13)]:
        x = torch.randn(m, k, generator=gen, dtype=torch.float32)
        x[0, 5] *= 40  # an outlier: its block's scale
        x[:, 64:128] = 0 if k > 64 else x[:, 64:128]  # a block of zeros: scale 0
        w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        w[0, :3] = torch.tensor([-127, 127, 0], dtype=torch.int8)  # the ends of the codes
        scale = torch.rand(n, generator=gen) / 50
        yield x.bfloat16(), w, scale.bfloat16()


@pytest.mark.parametrize("path", [1, 2], ids=["AVX2", "AVX-512 VNNI"])
def test_each_path_is_the_block_product(kernel, path):
    if path == 2 and kernel != "AVX-512 VNNI":
        pytest.skip("this CPU has no AVX-512 VNNI")
    for x, w, scale in cases():
        want = reference(x, w, scale)
        got = torch.ops.kvcli.int8_rows_path(x, w, scale, path).double()
        assert got.shape == want.shape
        assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()), (x.shape, w.shape)
    # and what runs by default is this CPU's best path
    x, w, scale = next(cases())
    assert torch.equal(torch.ops.kvcli.int8_rows(x, w, scale), torch.ops.kvcli.int8_rows_path(x, w, scale, 2 if kernel == "AVX-512 VNNI" else 1))  # fmt: skip


def test_the_activations_rounding_is_what_differs_from_exact_ones(kernel):
    """Against PyTorch's kernel (exact activations) the product differs by the activations' 8-bit
    rounding: more than float noise, well under a percent of its size."""
    x, w, scale = torch.randn(2, 1536).bfloat16(), *quantize_int8(torch.randn(96, 1536))
    layer = Int8Linear(w, scale, None, torch.bfloat16)
    exact = layer(x).double()
    layer.int8_rows = True
    rounded = layer(x).double()
    assert rounded.dtype == exact.dtype and rounded.shape == exact.shape
    diff = float((rounded - exact).norm() / exact.norm())
    assert 1e-4 < diff < 1e-2
    # a prompt's piece of more rows than decoding's stays on PyTorch's kernel: exact activations
    x = torch.randn(int8_rows.ROWS + 1, 1536).bfloat16()
    with_kernel = layer(x)
    layer.int8_rows = False
    assert torch.equal(with_kernel, layer(x))


QUESTIONS = (
    "What is the capital of France?",
    "What is the capital of France? Answer in one word.",
    "Which city is the capital of France?",
    "Name the capital city of France.",
)


def test_smollm2_answers_as_in_full_precision_with_its_decoding_in_8_bits(kernel):
    """SmolLM2 (8-bit weights, the embedded model) answers each rephrasing as in full precision with
    its decoding through the kernel. With its 37-token prompts read through it too (passes of up to
    63 rows), it answered two of the four with something else: hence :data:`int8_rows.ROWS`."""
    lm = load_model(None, quant="8bit")
    assert lm.int8_kernel == kernel
    for question in QUESTIONS:
        enc = lm.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.inference_mode():
            out = lm.model.generate(**enc, max_new_tokens=12, do_sample=False)
        assert "Paris" in lm.tokenizer.decode(out[0, enc["input_ids"].shape[1] :]), question


def test_a_model_load_sets_its_8bit_layers_and_its_fingerprint(kernel, tiny_dir, monkeypatch):
    """Asked for, the kernel runs every 8-bit layer whose inputs are whole blocks; by default (the
    variable unset) and with ``pytorch``, none: PyTorch's kernel, the fingerprint as before."""
    lm = load_model(str(tiny_dir("qwen2")), quant="8bit", device="cpu")
    layers = [m for m in lm.model.modules() if isinstance(m, Int8Linear)]
    assert lm.int8_kernel == kernel and layers
    assert all(m.int8_rows == (m.in_features % 64 == 0) for m in layers)
    monkeypatch.delenv(int8_rows.ENV)
    default = load_model(str(tiny_dir("qwen2")), quant="8bit", device="cpu")
    monkeypatch.setenv(int8_rows.ENV, "pytorch")
    plain = load_model(str(tiny_dir("qwen2")), quant="8bit", device="cpu")
    assert default.int8_kernel is None and default.fingerprint == plain.fingerprint
    assert plain.int8_kernel is None
    assert not any(m.int8_rows for m in plain.model.modules() if isinstance(m, Int8Linear))
    assert plain.fingerprint != lm.fingerprint  # the logits differ: so do the cache keys
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    a, b = lm.model(ids).logits, plain.model(ids).logits
    assert not torch.equal(a, b) and torch.allclose(a.float(), b.float(), atol=0.1, rtol=0.05)


def test_a_bad_setting_is_a_usage_error(monkeypatch):
    monkeypatch.setenv(int8_rows.ENV, "fast")
    with pytest.raises(UsageError, match="KVCLI_INT8_KERNEL must be pytorch or kvcli, not 'fast'"):
        int8_rows.load()


def test_a_failed_compile_raises_the_compilers_error_line(tmp_path, monkeypatch):
    bad = tmp_path / "bad.cpp"
    bad.write_text("int f( {\n")
    monkeypatch.setattr(int8_rows, "SOURCE", bad)
    with pytest.raises(OSError, match="error"):
        int8_rows.build(tmp_path / "kernels")
    assert not any((tmp_path / "kernels").iterdir())  # no half-written library left
