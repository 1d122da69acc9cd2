"""Sessions on a disk KV store for tiny models, and asking them (the store's tests and each
method's warm == cold checks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcli import notices
from kvcli.answer.pipeline import Pipeline
from kvcli.answer.prompt import load_template
from kvcli.api import AskOptions, Session
from kvcli.documents import document_from_text
from kvcli.runtime.engine import Engine
from kvcli.store import KVStore

DOC = " ".join(f"Entry {i}: the keeper logged {i * 7 % 13} ships and {i * 5 % 11} storms." for i in range(30))


Q1, Q2 = "How many ships were logged?", "Which entry mentions storms first?"


@pytest.fixture(autouse=True)
def silent_notices():
    """The store's warnings go nowhere and are forgotten after each test (they are read from
    ``notices.collected()``). Import it into a test module to apply it there (autouse)."""
    notices.reset()
    notices.set_sink(None)
    yield
    notices.reset()
    notices.set_sink(None)


def session_for(lm, cache_dir: Path | None, use_cache: bool = True, kv_bits: int = 16) -> Session:
    # no answer guard: these tests compare whole 8-token answers of random tiny models
    options = AskOptions(
        max_new_tokens=8, cache_dir=cache_dir, use_cache=use_cache, answer_guard=False, kv_bits=kv_bits
    )
    store = KVStore.open(cache_dir) if use_cache else None
    return Session(lm=lm, engine=Engine(lm), options=options, template=load_template(), store=store)


def ask(session, spec, question=Q1, doc=DOC):
    return session.ask(document_from_text(doc), question, Pipeline.parse(spec))


def entry_files(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / "kv").glob("*.safetensors"))
