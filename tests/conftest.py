"""Shared fixtures: tiny random models of every family, and the embedded model, each loaded once."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest


def _threads_per_worker() -> None:
    """Under pytest-xdist (the README's ``-n 2``), each worker's PyTorch, and every process a test
    starts, on its share of the CPUs (``OMP_NUM_THREADS``, read as PyTorch is imported below): two
    workers of two threads each on two cores wait at every kernel's barrier for a thread the other
    worker holds (measured: test_embedded and test_stdout_is_the_answer side by side, 189 s at
    PyTorch's default, 119 s at one thread a worker). A count the caller set is kept."""
    from kvcli.runtime.threads import allowed_cpus  # imports no PyTorch

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, len(allowed_cpus()) // workers))


_threads_per_worker()

from tests.helpers.tiny_models import FAMILIES, make_tiny_model  # noqa: E402  (after the thread count)


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="where the tiny test models and the embedded model run (default cpu: the GPU is hidden, "
        "so every model a test loads is CPU float32; cuda: the same tests, float32 on the GPU)",
    )


def pytest_configure(config):
    # On a GPU machine the models would load as bfloat16 on CUDA (device "auto"), and the tests are
    # written for float32 numbers: hide the GPU unless --device cuda asks for it (before anything
    # initialises CUDA, which reads CUDA_VISIBLE_DEVICES once).
    if config.getoption("--device") == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    config.addinivalue_line(
        "markers", "cpu_only(reason): a CPU-only behaviour (glibc mmap, a no-op note): skipped under --device cuda"
    )


@pytest.fixture(scope="session")
def device(pytestconfig):
    """The one place a test names its device: ``torch.device("cpu")`` unless ``pytest --device cuda``.
    The tiny models and the embedded model are loaded there; a test's own tensors are made there
    (``device=device``) or where the tensors they meet are (``x.device``, ``lm.device``), and a CLI
    run gets ``--device str(device)``: nothing in a test hardcodes "cpu" but a CPU-only check
    (marked ``cpu_only``, or loading its own model with ``device="cpu"``)."""
    import torch

    name = pytestconfig.getoption("--device")
    if name == "cuda" and not torch.cuda.is_available():
        pytest.exit("pytest --device cuda: no CUDA GPU on this machine", returncode=4)
    return torch.device(name)


@pytest.fixture(scope="session", autouse=True)
def isolated_cache_dir(tmp_path_factory):
    """Point KVCLI_CACHE_DIR at a fresh folder for the whole run: tests never read or write the
    user's cache. Its ``models/`` reuses, read only, the models the user's cache has already
    converted (:func:`tests.helpers.cache_dir.link_converted_models`), so the embedded model is not
    converted again; where it has none, the first test that needs the embedded model converts it
    into this folder (once per run, ~20 s)."""
    from kvcli.model import default_cache_dir
    from tests.helpers.cache_dir import link_converted_models

    root = tmp_path_factory.mktemp("kvcli-cache")
    link_converted_models(default_cache_dir() / "models", root / "models")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVCLI_CACHE_DIR", str(root))
        yield root


@pytest.fixture(scope="session", autouse=True)
def the_embedded_model_by_default():
    """Where a test names no model, SmolLM2 answers, whatever else is installed (kvcli's own default
    is the best embedded model installed: ``kvcli.model.catalog.default_model``); a test of that
    default unsets the variable itself. Set in the environment, so processes a test starts see it too."""
    from kvcli.model.embedded import EMBEDDED_MODEL
    from kvcli.model.names import MODEL_ENV

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(MODEL_ENV, EMBEDDED_MODEL)
        yield


@pytest.fixture(scope="session", autouse=True)
def threads_as_pytorch_has_them():
    """``--threads auto`` follows the machine's load (kvcli.runtime.threads), and one thread count's logits
    differ from another's in the last bits: in the tests it reads no /proc/stat, so it keeps
    PyTorch's count (heavy.sh's OMP_NUM_THREADS, a module's ``one_thread``). tests/test_threads.py
    gives the policy fake readings."""
    from kvcli.runtime import threads

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(threads, "PROC_STAT", Path("/nonexistent/kvcli-tests/stat"))
        mp.delenv(threads.ENV, raising=False)
        yield


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """``tiny_dir(family, **overrides)`` -> folder of a tiny random model (built once per session)."""
    root = tmp_path_factory.mktemp("tiny-models")

    @functools.cache
    def build(family: str, **overrides) -> Path:
        return make_tiny_model(family, root, **overrides)

    return build


@pytest.fixture(scope="session")
def tiny_lm(tiny_dir, device):
    """``tiny_lm(family, attn="sdpa", **overrides)`` -> LoadedModel of a 4-layer tiny model,
    float32 on the test device (:func:`device`)."""
    from kvcli.model import load_model

    @functools.cache
    def load(family: str, attn: str = "sdpa", **overrides):
        overrides.setdefault("num_hidden_layers", 4)
        return load_model(str(tiny_dir(family, **overrides)), attn=attn, device=str(device), dtype="float32")

    return load


@pytest.fixture
def reference(tiny_lm, tmp_path):
    """A book read of the tiny llama that never stopped (tests.helpers.books.answer): its answer and
    its store entry's tensors, what the resume and stall tests compare a stopped read with."""
    from kvcli.store import KVStore
    from tests.helpers.books import answer, entry_tensors

    result = answer(tiny_lm("llama"), KVStore.open(tmp_path / "reference"))
    [entry] = (tmp_path / "reference" / "kv").glob("*.safetensors")
    return result, entry_tensors(entry)


@pytest.fixture
def meta_engine(tiny_dir):
    """An :class:`kvcli.runtime.engine.Engine` over a 2-layer tiny llama whose weights live on PyTorch's
    ``meta`` device: shapes without data, any device but the CPU (a host tensor mixed in shows as a
    cross-device op; ``.item()`` raises)."""
    from kvcli.model import load_model
    from kvcli.runtime.engine import Engine

    lm = load_model(str(tiny_dir("llama", num_hidden_layers=2)), device="cpu", dtype="float32")
    lm.model.to("meta")
    return Engine(lm)


@pytest.fixture(scope="session")
def embedded_session(device):
    """The embedded SmolLM2 ready to answer (loaded once for the whole test session), float32 on
    the test device."""
    from kvcli.api import AskOptions, Session

    return Session.open(AskOptions(max_new_tokens=24, device=str(device), dtype="float32"))


@pytest.fixture(scope="module")
def gemma():
    """Gemma 3 270M in float32, or the test skipped where its packages are not installed."""
    from tests.helpers.embedded import embedded_or_skip

    return embedded_or_skip("gemma3-270m")


@pytest.fixture(scope="module")
def qwen_05b():
    """Qwen2.5-Coder-0.5B-Instruct in float32, or the test skipped where it is not installed."""
    from tests.helpers.embedded import embedded_or_skip

    return embedded_or_skip("qwen2.5-coder-0.5b")


@pytest.fixture
def cli(capsys, monkeypatch):
    """``cli("ask", doc, "Q?", ...)`` -> (exit code, stdout, stderr) of ``kvcli`` run in-process."""
    from tests.helpers.cli_runner import run_cli

    return lambda *args: run_cli(args, capsys, monkeypatch)


@pytest.fixture
def asks(monkeypatch):
    """Counts Session.ask calls (one per benchmark cell; warm-ups excluded); ``asks.fail_at = n``
    interrupts the n-th (Ctrl-C)."""
    from kvcli import api

    class Counter:
        calls = 0
        fail_at = None

    real = api.Session.ask

    def counting(self, document, *args, **kwargs):
        if document.source == "warm-up":  # the untimed warm-up answers are not cells
            return real(self, document, *args, **kwargs)
        Counter.calls += 1
        if Counter.fail_at == Counter.calls:
            raise KeyboardInterrupt
        return real(self, document, *args, **kwargs)

    monkeypatch.setattr(api.Session, "ask", counting)
    return Counter


def pytest_collection_modifyitems(config, items):
    # run the slow real-model tests last, so quick failures show first
    items.sort(key=lambda item: item.get_closest_marker("slow") is not None)
    if config.getoption("--device") != "cpu":
        for item in items:
            marker = item.get_closest_marker("cpu_only")
            if marker is not None:
                reason = marker.args[0] if marker.args else marker.kwargs.get("reason", "")
                item.add_marker(pytest.mark.skip(reason=f"CPU only: {reason}"))


__all__ = ["FAMILIES"]


@pytest.fixture(autouse=True)
def no_warnings_carried_over():
    """Each test starts with nothing said: a warning collected (:mod:`kvcli.notices`) by one test is
    never reported in the next one's JSON records, whatever the order the tests run in."""
    from kvcli import notices

    notices.reset()
    yield
