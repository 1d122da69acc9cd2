"""Shared fixtures: tiny random models of every family, and the embedded model, each loaded once."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tests.helpers.tiny_models import FAMILIES, make_tiny_model


@pytest.fixture(scope="session", autouse=True)
def isolated_cache_dir(tmp_path_factory):
    """Point KVCLI_CACHE_DIR at a fresh folder for the whole run, so tests never read or fill the
    user's disk KV cache; its ``models/`` links to the user's, so the embedded model is converted
    at most once per machine, not once per test run."""
    from kvcli.model import default_cache_dir

    real_models = default_cache_dir() / "models"
    real_models.mkdir(parents=True, exist_ok=True)
    root = tmp_path_factory.mktemp("kvcli-cache")
    (root / "models").symlink_to(real_models, target_is_directory=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVCLI_CACHE_DIR", str(root))
        yield root


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """``tiny_dir(family, **overrides)`` -> folder of a tiny random model (built once per session)."""
    root = tmp_path_factory.mktemp("tiny-models")

    @functools.cache
    def build(family: str, **overrides) -> Path:
        return make_tiny_model(family, root, **overrides)

    return build


@pytest.fixture(scope="session")
def tiny_lm(tiny_dir):
    """``tiny_lm(family, attn="sdpa", **overrides)`` -> LoadedModel of a 4-layer tiny model."""
    from kvcli.model import load_model

    @functools.cache
    def load(family: str, attn: str = "sdpa", **overrides):
        overrides.setdefault("num_hidden_layers", 4)
        return load_model(str(tiny_dir(family, **overrides)), attn=attn)

    return load


@pytest.fixture(scope="session")
def embedded_session():
    """The embedded SmolLM2 ready to answer (loaded once for the whole test session)."""
    from kvcli.api import AskOptions, Session

    return Session.open(AskOptions(max_new_tokens=24))


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


def pytest_collection_modifyitems(items):
    # run the slow real-model tests last, so quick failures show first
    items.sort(key=lambda item: item.get_closest_marker("slow") is not None)


__all__ = ["FAMILIES"]
