"""kvcli's int8 decoding kernels (kvcli/model/int8_rows.cpp), exact and 8-bit activations: each
product against an independent float64 computation on each path this CPU has, the exact one against
PyTorch's kernel, and how a model load picks them up or leaves them."""

from __future__ import annotations

import pytest
import torch

from kvcli.errors import UsageError
from kvcli.model import cpu_quant, int8_rows, load_model
from kvcli.model.cpu_quant import Int8Linear, quantize_int8


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """The 8-bit activations kernel's path on this CPU, asked for (``KVCLI_INT8_KERNEL=8bit``) for
    the module and compiled once; skipped where it cannot be."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(int8_rows.ENV, "8bit")
        path = int8_rows.load(tmp_path_factory.mktemp("kernels"))
        if path is None:
            pytest.skip("kvcli's int8 kernel does not load here (no C++ compiler, or neither AVX2 nor AVX-512 VNNI)")
        yield path


@pytest.fixture(scope="module")
def exact_kernel(tmp_path_factory):
    """The exact kernel's path on this CPU (the default), compiled once; skipped where it cannot be."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(int8_rows.ENV, raising=False)
        path = int8_rows.load(tmp_path_factory.mktemp("kernels"))
        if path is None:
            pytest.skip("kvcli's int8 kernel does not load here (no C++ compiler, or no AVX2)")
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


def exact_cases():
    """Inputs a multiple of 32 but not always of 64, activation rows 1..8 (the AVX-512 path takes them
    4, 2 and 1 at a time, the AVX2 one 2 and 1), weight rows not a multiple of the tile of 4."""
    gen = torch.Generator().manual_seed(1)
    for m, k, n in [(1, 32, 1), (1, 1536, 37), (2, 96, 5), (3, 160, 8), (5, 576, 13), (8, 224, 6)]:
        x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 2, k)  # magnitudes over five decades
        w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        w[0, :3] = torch.tensor([-127, 127, 0], dtype=torch.int8)
        yield x.bfloat16(), w, (torch.rand(n, generator=gen) / 50).bfloat16()


@pytest.mark.parametrize("path", [1, 2], ids=["AVX2", "AVX-512"])
def test_each_exact_path_is_the_float64_product(exact_kernel, path):
    if path == 2 and exact_kernel != "AVX-512":
        pytest.skip("this CPU has no AVX-512")
    for x, w, scale in exact_cases():
        want = x.double() @ w.double().t() * scale.double()
        got = torch.ops.kvcli.int8_rows_exact_path(x, w, scale, path)
        assert got.dtype == torch.float32 and got.shape == want.shape
        # float32 sums of exact products: within a few float32 roundings of the sum of magnitudes
        bound = 1e-6 * (x.double().abs() @ w.double().abs().t() * scale.double())
        assert bool(((got.double() - want).abs() <= bound).all()), (x.shape, w.shape)
    x, w, scale = next(exact_cases())
    best = 2 if exact_kernel == "AVX-512" else 1
    assert torch.equal(
        torch.ops.kvcli.int8_rows_exact(x, w, scale), torch.ops.kvcli.int8_rows_exact_path(x, w, scale, best)
    )


def test_the_exact_kernel_is_pytorchs_up_to_the_last_bit(exact_kernel):
    """Through a layer, in bfloat16 as decoding runs: PyTorch's kernel's output, each value equal
    or one bfloat16 step away (float32 sums in another order, rounded once more)."""
    x, w, scale = torch.randn(4, 1536).bfloat16(), *quantize_int8(torch.randn(300, 1536))
    layer = Int8Linear(w, scale, None, torch.bfloat16)
    theirs = layer(x)
    layer.rows_kernel, layer.kernel_rows = int8_rows.exact, 63
    ours = layer(x)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    step = theirs.float().abs() * 2**-7
    assert bool(((ours.float() - theirs.float()).abs() <= step).all())
    assert (ours == theirs).float().mean() > 0.9


@pytest.mark.parametrize("native", [True, False], ids=["native-bfloat16", "emulated-bfloat16"])
def test_the_exact_kernel_runs_every_pass_below_the_dense_weights(exact_kernel, tiny_dir, monkeypatch, native):
    """A model load sets the exact kernel for every pass of fewer rows than the weights are made
    dense for (a question's tail, the check after an answer), not only decoding's: dense_rows where
    the 16-bit GEMM is native, FLOAT_ROWS where it is emulated (an AVX2-only CPU), whichever this CPU is."""
    monkeypatch.delenv(int8_rows.ENV, raising=False)
    monkeypatch.setattr(cpu_quant, "fast_gemm", lambda dtype: native or dtype == torch.float32)
    lm = load_model(str(tiny_dir("qwen2")), quant="8bit", device="cpu")
    layer = next(m for m in lm.model.modules() if isinstance(m, Int8Linear) and m.rows_kernel is not None)
    most = (Int8Linear.dense_rows if native else cpu_quant.FLOAT_ROWS) - 1
    assert layer.kernel_rows == most > int8_rows.ROWS
    kernels = [m for m in lm.model.modules() if isinstance(m, Int8Linear) and m.rows_kernel is not None]
    assert any(m.dense_rows is None for m in kernels)  # the LM head, never dense: bounded as the layers
    assert {m.kernel_rows for m in kernels} == {most}
    calls, made = [], []
    monkeypatch.setattr(layer, "rows_kernel", lambda *a: calls.append(a[0].shape[0]) or int8_rows.exact(*a))
    monkeypatch.setattr(layer, "dense_product", lambda x, dtype: made.append(dtype) or torch.mm(x, layer.dense(dtype)))
    for rows in (1, 9, most, most + 1):
        layer(torch.randn(rows, layer.in_features).bfloat16())
    assert calls == [1, 9, most]  # from there the dense weights, in float32 where bfloat16 is emulated
    assert made == [torch.bfloat16 if native else torch.float32]


@pytest.mark.parametrize("path", [1, 2], ids=["AVX2", "AVX-512"])
def test_the_dense_weights_are_pytorchs_bits(exact_kernel, path):
    """The weights made dense for a prefill (int8_rows_dense), on each path this CPU has: bit for bit
    PyTorch's ``torch.mul(codes, scale[:, None])`` in bfloat16 and in float32, rows and widths of
    any size (tails of the vectors), scales over eight decades (bfloat16's rounding at each)."""
    if path == 2 and exact_kernel != "AVX-512":
        pytest.skip("this CPU has no AVX-512")
    gen = torch.Generator().manual_seed(2)
    for n, k in [(1, 1), (5, 33), (70, 100), (129, 1536)]:
        w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        w[0, :1] = -127
        scale = (torch.rand(n, generator=gen) * torch.logspace(-6, 2, n)).bfloat16()
        for dtype, bits in ((torch.bfloat16, torch.int16), (torch.float32, torch.int32)):
            want = torch.mul(w, scale.to(dtype)[:, None])
            got = torch.ops.kvcli.int8_rows_dense(w, scale, dtype == torch.bfloat16, path)
            assert got.dtype == dtype and torch.equal(got.view(bits), want.view(bits)), (n, k, dtype)


def test_a_model_load_makes_its_dense_weights_with_the_kernel(exact_kernel, tiny_dir, monkeypatch):
    """Every 8-bit layer of a loaded model makes its dense weights with kvcli's kernel where it loads
    (any input width), PyTorch's bits; with ``pytorch`` PyTorch's multiplication."""
    monkeypatch.delenv(int8_rows.ENV, raising=False)
    lm = load_model(str(tiny_dir("qwen2")), quant="8bit", device="cpu")
    layers = [m for m in lm.model.modules() if isinstance(m, Int8Linear)]
    assert layers and all(m.dense_kernel is int8_rows.dense for m in layers)
    for layer in layers:
        for dtype in (torch.bfloat16, torch.float32):
            want = torch.mul(layer.codes, layer.scale.to(dtype)[:, None]).t()
            assert torch.equal(layer.dense(dtype), want)
    monkeypatch.setenv(int8_rows.ENV, "pytorch")
    plain = load_model(str(tiny_dir("qwen2")), quant="8bit", device="cpu")
    assert not any(m.dense_kernel for m in plain.model.modules() if isinstance(m, Int8Linear))


def test_the_activations_rounding_is_what_differs_from_exact_ones(kernel):
    """Against PyTorch's kernel (exact activations) the product differs by the activations' 8-bit
    rounding: more than float noise, well under a percent of its size."""
    x, w, scale = torch.randn(2, 1536).bfloat16(), *quantize_int8(torch.randn(96, 1536))
    layer = Int8Linear(w, scale, None, torch.bfloat16)
    exact = layer(x).double()
    layer.rows_kernel, layer.kernel_rows = int8_rows.product, int8_rows.ROWS
    rounded = layer(x).double()
    assert rounded.dtype == exact.dtype and rounded.shape == exact.shape
    diff = float((rounded - exact).norm() / exact.norm())
    assert 1e-4 < diff < 1e-2
    # a prompt's piece of more rows than decoding's stays on PyTorch's kernel: exact activations
    x = torch.randn(int8_rows.ROWS + 1, 1536).bfloat16()
    with_kernel = layer(x)
    layer.rows_kernel = None
    assert torch.equal(with_kernel, layer(x))


QUESTIONS = (
    "What is the capital of France?",
    "What is the capital of France? Answer in one word.",
    "Which city is the capital of France?",
    "Name the capital city of France.",
)


def test_smollm2_answers_as_in_full_precision_with_its_decoding_in_8_bits(kernel, monkeypatch):
    """SmolLM2 (8-bit weights, the embedded model) answers each rephrasing as in full precision with
    its decoding through the 8-bit activations kernel. With its 37-token prompts read through it too
    (passes of up to 63 rows), it answered two of the four with something else: hence
    :data:`int8_rows.ROWS`."""
    monkeypatch.setenv(int8_rows.ENV, "8bit")
    lm = load_model(None, quant="8bit")
    assert lm.int8_kernel == f"8bit, {kernel}"
    for question in QUESTIONS:
        enc = lm.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.inference_mode():
            out = lm.model.generate(**enc, max_new_tokens=12, do_sample=False)
        assert "Paris" in lm.tokenizer.decode(out[0, enc["input_ids"].shape[1] :]), question


def kernels_of(lm):
    return [m.rows_kernel for m in lm.model.modules() if isinstance(m, Int8Linear)]


def test_a_model_load_sets_its_8bit_layers_and_its_fingerprint(kernel, exact_kernel, tiny_dir, monkeypatch):
    """By default (the variable unset) the exact kernel runs every 8-bit layer whose inputs it takes
    whole, the fingerprint PyTorch's kernel's (the logits differ by rounding alone); ``8bit`` the
    8-bit activations kernel, a fingerprint of its own (its logits differ); ``pytorch`` none."""
    monkeypatch.delenv(int8_rows.ENV, raising=False)
    default = load_model(str(tiny_dir("qwen2")), quant="8bit", device="cpu")
    ins = [m.in_features for m in default.model.modules() if isinstance(m, Int8Linear)]
    assert default.int8_kernel == f"exact, {exact_kernel}" and ins
    assert kernels_of(default) == [int8_rows.exact if n % 32 == 0 else None for n in ins]
    monkeypatch.setenv(int8_rows.ENV, "8bit")
    rounding = load_model(str(tiny_dir("qwen2")), quant="8bit", device="cpu")
    assert rounding.int8_kernel == f"8bit, {kernel}"
    assert kernels_of(rounding) == [int8_rows.product if n % 64 == 0 else None for n in ins]
    assert {m.kernel_rows for m in rounding.model.modules() if getattr(m, "rows_kernel", None)} == {int8_rows.ROWS}
    monkeypatch.setenv(int8_rows.ENV, "pytorch")
    plain = load_model(str(tiny_dir("qwen2")), quant="8bit", device="cpu")
    assert plain.int8_kernel is None and not any(kernels_of(plain))
    assert default.fingerprint == plain.fingerprint != rounding.fingerprint  # the 8-bit logits differ: the keys too
    ids = torch.tensor([[1, 2, 3, 4, 5]])  # a pass of 5 rows, as decoding's draft checks: through the kernels
    with torch.inference_mode():
        a, b, c = (lm.model(ids).logits for lm in (default, plain, rounding))
    assert torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    assert not torch.equal(c, b) and torch.allclose(c.float(), b.float(), atol=0.1, rtol=0.05)


def test_a_bad_setting_is_a_usage_error(monkeypatch):
    monkeypatch.setenv(int8_rows.ENV, "fast")
    with pytest.raises(UsageError, match="KVCLI_INT8_KERNEL must be exact, 8bit or pytorch, not 'fast'"):
        int8_rows.load()


def test_a_failed_compile_raises_the_compilers_error_line(tmp_path, monkeypatch):
    bad = tmp_path / "bad.cpp"
    bad.write_text("int f( {\n")
    monkeypatch.setattr(int8_rows, "SOURCE", bad)
    with pytest.raises(OSError, match="error"):
        int8_rows.build(tmp_path / "kernels")
    assert not any((tmp_path / "kernels").iterdir())  # no half-written library left


def test_a_missing_compiler_is_noted_once_a_cache_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(int8_rows.shutil, "which", lambda name: None)
    folder = tmp_path / "kernels"
    assert int8_rows.no_compiler(folder)
    assert "no C++ compiler (install g++)" in capsys.readouterr().err
    assert int8_rows.no_compiler(folder) and capsys.readouterr().err == ""  # a later process: silent
    monkeypatch.setattr(int8_rows.shutil, "which", lambda name: "/usr/bin/c++")  # installed since: compiled
    assert not int8_rows.no_compiler(folder)
