"""A chat's idle time: after an answer that ranked the pages with a sentence-embedding model, the
rest of the document's pages are embedded while the user types (Session.embed_rest, in a thread
the chat stops before the next question: kvcli.cli.chat.Idle); a later question then embeds none."""

from __future__ import annotations

import threading

from kvcli.answer.pipeline import Pipeline
from kvcli.cli.chat import Idle
from kvcli.documents import Document
from kvcli.retrieval import embed, vectors
from tests.helpers.embedders import Counting, paged_document
from tests.helpers.stores import session_for

PAGES = [
    f"Page {i}: the keeper logs the {word} lamp."
    for i, word in enumerate(["red", "green", "blue", "amber", "white", "grey"])
]


def document() -> Document:
    return paged_document(PAGES)


def test_the_rest_of_the_pages_is_embedded_and_a_later_question_embeds_none(tiny_lm, tmp_path, monkeypatch):
    model = Counting()
    monkeypatch.setattr(embed, "embedder", lambda name: model)
    monkeypatch.delenv(embed.ENV, raising=False)
    session = session_for(tiny_lm("llama"), tmp_path)
    doc, pages = document(), Pipeline.parse("pages:candidates=2")
    first = session.ask(doc, "Which lamp is amber?", pages)
    assert first.selection.ranked_by.startswith("bm25+") and model.calls >= 1
    path = session.embed_rest(first, threading.Event())
    texts = [p.text for p in first.prompt.passages]
    assert path == vectors.path_for(tmp_path, vectors.key(model.id, texts)) and len(texts) == len(PAGES)
    assert vectors.load(path, vectors.key(model.id, texts))[2].all()
    calls = model.calls
    session.ask(doc, "Which lamp is grey?", pages)
    assert model.calls == calls + 1  # the question's own vector: no passage embedded
    assert session.embed_rest(first, threading.Event()) is None  # nothing left to write
    full = session.ask(doc, "Which lamp is red?", Pipeline.parse("full"))
    assert session.embed_rest(full, threading.Event()) is None  # a reading that ranks nothing


def test_idle_stops_its_thread_before_the_next_question_and_makes_room_for_what_it_wrote(tmp_path):
    started, made = threading.Event(), []

    class Session:
        def embed_rest(self, result, stop):
            started.set()
            stop.wait(5)  # a step ends when asked to stop
            return tmp_path / "written.safetensors" if stop.is_set() else None

        def made(self, path):
            made.append(path)

    idle = Idle(Session())
    idle.start(result=None)
    assert started.wait(5) and idle.thread.is_alive()
    idle.stop()
    assert idle.thread is None and made == [tmp_path / "written.safetensors"]
    idle.stop()  # nothing running: nothing to do
    assert made == [tmp_path / "written.safetensors"]
