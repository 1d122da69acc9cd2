"""The kvcli command line as a user meets it: exit codes, stdout/stderr, one-line errors.

Every test but one calls ``kvcli.cli:main`` in-process (``run_cli``) with ``sys.argv`` patched;
``test_real_entry_point_matches_in_process`` runs ``python -m kvcli`` in a subprocess to prove
the real entry point behaves the same. Models are tiny random ones (``tiny_dir``), so answers
are gibberish: these tests check structure, not content.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvcli.documents import load_document
from tests.helpers.cli_runner import assert_user_error, run_cli

REPO = Path(__file__).resolve().parents[2]

WORDS = ["alpha", "beta", "gamma", "delta", "harbour", "blue", "passkey", "river", "stone", "lamp"]

JSON_KEYS = (
    "answer",
    "compressor",
    "model",
    "n_context_tokens",
    "n_kept_tokens",
    "compression_ratio",
    "n_selected_tokens",
    "prompt_computed_frac",
    "kv_attended_frac",
    "ttft_s",
    "total_s",
    "peak_mem_mb",
)


# --- helpers ---------------------------------------------------------------------------------


@pytest.fixture
def cli(capsys, monkeypatch):
    """``cli(*args) -> (code, stdout, stderr)``."""
    return lambda *args: run_cli(args, capsys, monkeypatch)


def words(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n)) + "."


def no_ws(text: str) -> str:
    return "".join(text.split())


# --- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tiny_dir) -> str:
    return str(tiny_dir("llama", num_hidden_layers=4))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Documents good and bad, built once."""
    from fpdf import FPDF
    from pypdf import PdfReader, PdfWriter

    d = tmp_path_factory.mktemp("cli-docs")
    f: dict[str, Path] = {}

    f["doc"] = d / "doc.txt"
    f["doc"].write_text(words(150) + "\n", encoding="utf-8")
    f["long"] = d / "long.txt"
    f["long"].write_text(words(2000, seed=1) + "\n", encoding="utf-8")
    f["empty"] = d / "empty.txt"
    f["empty"].write_text("\n  \n", encoding="utf-8")
    f["docx"] = d / "report.docx"
    f["docx"].write_bytes(b"PK\x03\x04 not really a docx")
    f["dir"] = d / "folder.txt"  # a directory (read as a folder of documents), with no documents in it
    f["dir"].mkdir()
    f["corrupt"] = d / "corrupt.pdf"
    f["corrupt"].write_bytes(random.Random(0).randbytes(2048))

    pdf = FPDF()
    pdf.set_font("Helvetica", size=12)
    for seed in (2, 3):
        pdf.add_page()
        pdf.multi_cell(0, 8, words(120, seed=seed))
    f["pdf"] = d / "two-pages.pdf"
    pdf.output(str(f["pdf"]))

    image_only = FPDF()
    image_only.add_page()
    image_only.rect(20, 20, 60, 30, style="F")
    f["image_only"] = d / "scan.pdf"
    image_only.output(str(f["image_only"]))

    writer = PdfWriter(clone_from=PdfReader(f["pdf"]))
    writer.encrypt("secret")
    f["encrypted"] = d / "locked.pdf"
    with open(f["encrypted"], "wb") as fh:
        writer.write(fh)
    return f


# --- documents that cannot be read: exit 1, one line naming the file -------------------------


@pytest.mark.parametrize(
    "key, needles",
    [
        ("missing", ["does not exist"]),
        ("dir", ["no .pdf", "files in this folder"]),  # a folder is read recursively; this one is empty
        ("docx", ["unsupported file type '.docx'", ".pdf", ".txt"]),
        ("empty", ["is empty"]),
        ("encrypted", ["protected by a password", "qpdf --password"]),
        ("image_only", ["no extractable text", "OCR"]),
        ("corrupt", ["not a valid PDF"]),
    ],
)
def test_unreadable_document(cli, files, model, key, needles):
    path = files["doc"].with_name("nope.txt") if key == "missing" else files[key]
    line = assert_user_error(cli("ask", path, "What is it?", "-m", model), 1, *needles)
    assert path.name in line


# --- bad compressor specs: exit 2 before anything is loaded ----------------------------------


@pytest.mark.parametrize(
    "spec, needles",
    [
        ("nosuch", ["unknown compressor 'nosuch'", "gemfilter", "full"]),
        ("gemfilter:foo=1", ["unknown knob 'foo'", "layer", "k (", "kernel"]),
        ("gemfilter:k=abc", ["'k'", "int", "'abc'"]),
        ("gemfilter:kernel=4", ["kernel", "odd"]),
        ("gemfilter:k", ["knob=value"]),
        ("full+", ["empty compressor"]),
        ("gemfilter:k=8,k=16", ["knob 'k' is given twice"]),
        ("gemfilter:k=8,layer=2,k=8", ["knob 'k' is given twice"]),
    ],
)
def test_bad_compressor_spec(cli, files, spec, needles):
    # the model does not exist: a spec error must come first, before any loading
    assert_user_error(cli("ask", files["doc"], "q", "-c", spec, "-m", "/nonexistent/model"), 2, *needles)


def test_knob_that_does_not_fit_the_model(cli, files, model):
    assert_user_error(cli("ask", files["doc"], "q", "-m", model, "-c", "gemfilter:layer=99"), 2, "layer=99", "4 layers")


def test_explicit_k_larger_than_prompt(cli, files, model):
    assert_user_error(
        cli("ask", files["doc"], "q", "-m", model, "-c", "gemfilter:k=100000", "--max-new-tokens", "4"),
        2,
        "k=100000",
        "larger than the prompt",
    )


# --- model and hardware errors: exit 1 -------------------------------------------------------


def test_missing_model(cli, files):
    assert_user_error(cli("ask", files["doc"], "q", "-m", "/nonexistent/model"), 1, "/nonexistent/model")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_gpu(cli, files, model):
    assert_user_error(cli("ask", files["doc"], "q", "-m", model, "--device", "cuda"), 1, "CUDA")


def test_attn_flash(cli, files, model):
    # on CPU: needs a CUDA GPU; on a GPU machine without flash-attn: needs the package
    line = assert_user_error(cli("ask", files["doc"], "q", "-m", model, "--attn", "flash"), 1, "--attn flash")
    assert "CUDA" in line or "flash-attn" in line or "dtype" in line


def test_document_longer_than_the_model_window(cli, files, tiny_dir):
    short = str(tiny_dir("llama", num_hidden_layers=4, max_position_embeddings=256))
    # the refusal names the option that works
    assert_user_error(
        cli("ask", files["long"], "q", "-m", short, "--max-new-tokens", "4", "-c", "full"),
        1,
        "256",
        "window",
        "-c finch",
    )
    # the default reads it: -c auto hands a document longer than the window to pages
    code, out, err = cli("ask", files["long"], "q", "-m", short, "--max-new-tokens", "4", "--json")
    assert code == 0, err
    record = json.loads(out)
    assert record["policy"] == "auto" and record["compressor"].startswith("pages:")
    # it says what it read, and no compression ratio against a full attention that cannot run
    assert record["n_context_tokens"] > 256 and record["compression_ratio"] is None
    assert 0 < record["read"]["n_tokens"] < record["n_document_tokens"] == record["read"]["n_document_tokens"]
    code, out, err = cli("ask", files["long"], "q", "-m", short, "--max-new-tokens", "4", "--no-sources")
    assert code == 0, err
    stats = err.splitlines()[-1]
    read = record["read"]
    assert f"of {read['n_document_tokens']:,} document tokens" in stats and "×" not in stats, stats
    where = read["passages"][0]["lines"]
    assert (f"line {where[0]}" if where[0] == where[1] else f"lines {where[0]}-{where[1]}") in stats


# --- Typer/click usage errors: exit 2, one short line, no traceback ---------------------------


@pytest.mark.parametrize(
    "args, needles",
    [
        (["ask"], ["DOCUMENT... QUESTION"]),
        (["ask", "DOC"], ["a document and a question"]),
        (["ask", "DOC", "q", "--device", "foo"], ["Invalid value for '--device': 'foo' is not one of 'auto', 'cpu'"]),
        (["ask", "DOC", "q", "--quant", "3bit"], ["--quant"]),
        (["ask", "DOC", "q", "--max-new-tokens", "0"], ["--max-new-tokens"]),
        (["ask", "DOC", "q", "--bogus"], ["--bogus"]),
        (["nosuchcommand"], ["nosuchcommand"]),
    ],
)
def test_click_usage_errors(cli, files, args, needles):
    args = [files["doc"] if a == "DOC" else a for a in args]
    line = assert_user_error(cli(*args), 2, *needles)
    assert "--help" in line  # points at the help


def test_help(cli):
    code, out, err = cli("--help")
    assert code == 0, err
    assert "ask" in out and "compressors" in out
    assert "Traceback" not in out + err

    code, out, err = cli("ask", "--help")
    assert code == 0, err
    assert "--compressor" in out and "--show-selected" in out


def test_no_arguments_shows_help(cli):
    code, out, err = cli()
    assert code in (0, 2)  # click >= 8.2 and Typer's standalone mode exit 2 here
    assert "Usage" in out + err and "ask" in out + err
    assert "Traceback" not in out + err and "internal error" not in err


def test_compressors(cli):
    code, out, err = cli("compressors")
    assert code == 0, err
    assert "Traceback" not in out + err
    assert "gemfilter" in out and "full" in out
    code, out, err = cli("compressors", "gemfilter")  # a method's knobs, one row each (issue 41: no longer all at once)
    assert code == 0, err
    for knob in ("layer", "k", "kernel"):
        assert re.search(rf"^\s*{knob}\s", out, re.M), knob


# --- answering -------------------------------------------------------------------------------


def ask_json(cli, path, model, *extra):
    code, out, err = cli("ask", path, "What is it?", "-m", model, "--json", "--max-new-tokens", "4", *extra)
    assert code == 0, err
    assert "Traceback" not in out + err
    assert out.endswith("\n") and out.count("\n") == 1, out  # exactly one JSON object, one line
    return json.loads(out), err


def test_json_full(cli, files, model):
    record, err = ask_json(cli, files["doc"], model, "-c", "full")
    assert err == ""
    for key in JSON_KEYS:
        assert key in record, key
    assert isinstance(record["answer"], str)
    assert record["compressor"] == "full"
    assert record["model"]
    assert type(record["n_context_tokens"]) is int and record["n_context_tokens"] > 0
    # the KV held: a mean over layers and KV heads, so a number (whole for full attention)
    assert isinstance(record["n_kept_tokens"], float) and record["n_kept_tokens"] > 0
    assert record["compression_ratio"] == 1.0 and record["n_selected_tokens"] == record["n_context_tokens"]
    for key in ("ttft_s", "total_s", "peak_mem_mb"):
        assert isinstance(record[key], (int, float)) and not isinstance(record[key], bool)
        assert record[key] >= 0
    assert record["ttft_s"] <= record["total_s"]
    assert record["n_kept_tokens"] == record["n_context_tokens"]
    assert "selected_spans" not in record


def test_json_gemfilter_selected_spans(cli, files, model):
    record, _ = ask_json(cli, files["doc"], model, "-c", "gemfilter:k=32,layer=2", "--show-selected")
    assert record["compressor"].startswith("gemfilter:") and "k=32" in record["compressor"]
    assert record["n_kept_tokens"] == 32 < record["n_context_tokens"]
    spans = record["selected_spans"]
    assert spans
    text = load_document(files["doc"]).text
    for span in spans:
        assert {"start", "end", "page", "text"} <= span.keys()
        assert 0 <= span["start"] < span["end"] <= len(text)
        assert text[span["start"] : span["end"]] == span["text"]
        assert span["page"] == 1
        assert span["cited"] == any(c["start"] < span["end"] and span["start"] < c["end"] for c in record["sources"])
    cited = record["sources"]  # each overlaps a kept span: gemfilter's second pass read nothing else
    assert cited and all(any(c["start"] < s["end"] and s["start"] < c["end"] for s in spans) for c in cited)


def test_plain_text_answer_and_stats(cli, files, model):
    spec = "gemfilter:k=32,layer=2"  # its canonical spec makes the stats line longer than 80 columns
    args = ("ask", files["doc"], "What is it?", "-m", model, "-c", spec, "--max-new-tokens", "4")
    record, _ = ask_json(cli, files["doc"], model, "-c", spec)

    code, out, err = cli(*args)
    assert code == 0, err
    assert out == record["answer"] + "\n"  # a pipe: stdout is the answer alone (greedy: the JSON run's)
    lines = err.splitlines()
    assert len(lines) == 1, err  # the stats line, one line even in a pipe
    assert lines[0].startswith("gemfilter:layer=2,k=32 · ")  # the knobs the user set ...
    assert len(record["compressor"]) > 30  # ... every knob in the JSON
    assert f"kept 32/{record['n_context_tokens']}" in lines[0] and "TTFT" in lines[0]
    assert "Traceback" not in err

    # --sources: then its sources (best first, or why none is clear)
    code, out, err = cli(*args, "--sources")
    assert code == 0, err
    assert out.startswith(record["answer"] + "\n") and all(s["text"][:20] in out for s in record["sources"]), out
    assert (record["sources_note"] is None) == ("no clear source" not in out)

    code, out, err = cli(*args, "--quiet")
    assert code == 0
    assert out == record["answer"] + "\n"
    assert err == ""


def test_show_selected_text_shows_every_kept_span(cli, files, model):
    record, _ = ask_json(cli, files["doc"], model, "-c", "gemfilter:k=32,layer=2", "--show-selected")
    code, out, err = cli(
        "ask", files["doc"], "What is it?", "-m", model, "-c", "gemfilter:k=32,layer=2", "--show-selected",
        "--max-new-tokens", "4",
    )  # fmt: skip
    assert code == 0, err
    assert out.startswith(record["answer"] + "\n")
    assert "kept 32 of" in out and "p.1" in out
    flat = no_ws(out)  # rows may fold at the console width
    for span in record["selected_spans"]:
        assert no_ws(span["text"]) in flat, span


def test_pdf_show_selected_page_labels(cli, files, model):
    code, out, err = cli(
        # k above the ~30 tokens after the document (instructions + question), which are always kept
        "ask", files["pdf"], "What is it?", "-m", model, "-c", "gemfilter:k=64,layer=2", "--show-selected",
        "--max-new-tokens", "4",
    )  # fmt: skip
    assert code == 0, err
    assert "Traceback" not in out + err
    assert re.search(r"p\.[12]\b", out), out

    record, _ = ask_json(cli, files["pdf"], model, "-c", "gemfilter:k=64,layer=2", "--show-selected")
    assert record["n_pages"] == 2
    text = load_document(files["pdf"]).text
    assert record["selected_spans"]
    for span in record["selected_spans"]:
        assert span["page"] in (1, 2)
        assert text[span["start"] : span["end"]] == span["text"]


def test_ctrl_c_exits_130(cli, files, model, monkeypatch):
    from kvcli import api

    def interrupted(options):
        raise KeyboardInterrupt

    monkeypatch.setattr(api.Session, "open", interrupted)
    code, out, err = cli("ask", files["doc"], "q", "-m", model)
    assert code == 130
    assert out == "" and "Traceback" not in err
    assert "interrupted" in err


@pytest.mark.parametrize(
    "command",
    [
        ["ask", "{doc}", "q?"],
        ["chat", "{doc}"],
        ["inspect", "{doc}", "q?"],
        ["bench", "needle", "--out", "{out}", "--lengths", "256"],
    ],
    ids=lambda c: " ".join(c[:2]).replace(" {doc}", ""),
)
def test_every_command_that_loads_a_model_gets_its_model_options(cli, files, model, command, tmp_path, monkeypatch):
    """kvcli.cli.options.loads_a_model: the options each command declares through it reach the
    library's AskOptions as given (the session's opening is stopped there)."""
    from kvcli import api

    opened = []

    def stopped(options):
        opened.append(options)
        raise KeyboardInterrupt

    monkeypatch.setattr(api.Session, "open", stopped)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # chat: questions over a pipe, none
    args = [a.format(doc=files["doc"], out=tmp_path) for a in command]
    given = ["-m", model, "--device", "cpu", "--quant", "8", "--attn", "eager", "--dtype", "bfloat16"]
    code, _, err = cli(*args, *given, "--threads", "1", "--kv-bits", "4")
    assert code == 130 and "Traceback" not in err, err
    [options] = opened
    assert (options.model, options.device, options.quant, options.attn, options.dtype) == (
        model,
        "cpu",
        "8",  # as --quant and --json spell it
        "eager",
        "bfloat16",
    )
    assert (options.threads, options.kv_bits) == ("1", 4)


# --- the real entry point --------------------------------------------------------------------


@pytest.mark.e2e
def test_real_entry_point_matches_in_process(cli, files, model):
    missing = files["doc"].with_name("missing.txt")
    args = ["ask", str(missing), "q", "-m", model]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("KVCLI_DEBUG", None)
    proc = subprocess.run(
        [sys.executable, "-m", "kvcli", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    line = assert_user_error((proc.returncode, proc.stdout, proc.stderr), 1, "missing.txt", "does not exist")
    assert (proc.returncode, proc.stdout, proc.stderr) == cli(*args)
    assert line == f"kvcli: error: '{missing}' does not exist"


@pytest.mark.parametrize(
    "spec, note",
    [
        ("full", "--kv-offload cpu has no effect on full: only blocksparse"),
        ("blocksparse", "--kv-offload cpu has no effect: the model runs on the cpu"),
    ],
)
def test_kv_offload_without_effect_says_so_once(spec, note, files, model, capsys, monkeypatch):
    code, out, err = run_cli(
        [
            "ask",
            files["doc"],
            "Who keeps the light?",
            "--model",
            model,
            "-c",
            spec,
            "--kv-offload",
            "cpu",
            "--json",
            "--max-new-tokens",
            "2",
            "--no-cache",
            "--device",
            "cpu",  # the notes are about a model on the CPU
        ],
        capsys,
        monkeypatch,
    )
    assert code == 0, err
    record = json.loads(out)
    assert any(note in w for w in record["warnings"]), record["warnings"]
    assert err.count("kvcli: warning:") == 1 and note in err


# --- questions ---------------------------------------------------------------------------------


def test_a_question_with_questions_file_is_a_usage_error(cli, files, tmp_path):
    questions = tmp_path / "q.txt"
    questions.write_text("Who keeps the light?\n")
    for extra in ("Extra?", "What is it", "notes"):  # not documents: a glob that matches nothing, words
        line = assert_user_error(
            cli("ask", files["doc"], extra, "--questions", questions, "-m", "/nonexistent/model"), 2, f"'{extra}'"
        )
        assert "a QUESTION and --questions exclude each other" in line
    # documents that cannot be read stay documents (exit 1, named)
    assert_user_error(
        cli("ask", files["doc"].with_name("gone.txt"), "--questions", questions, "-m", "/nonexistent/model"),
        1,
        "gone.txt",
    )


@pytest.mark.parametrize("question", ["", "   ", "\n"])
def test_an_empty_question_is_a_usage_error(cli, files, question):
    assert_user_error(cli("ask", files["doc"], question, "-m", "/nonexistent/model"), 2, "the question is empty")
    assert_user_error(cli("inspect", files["doc"], question, "-m", "/nonexistent/model"), 2, "the question is empty")


# --- a cold first run: the embedded model's conversion says so --------------------------------


def test_the_embedded_models_conversion_is_announced_when_stderr_is_not_a_terminal(cli, files, tmp_path, monkeypatch):
    from kvcli.model import embedded as models

    def convert(gguf, dest):  # stands for the ~20 s conversion; stop there
        raise RuntimeError("stopped by the test")

    monkeypatch.setattr(models, "_convert_gguf", convert)
    code, out, err = cli("ask", files["doc"], "What is it?", "--cache-dir", tmp_path / "fresh")
    lines = err.splitlines()
    assert code == 1 and out == "" and len(lines) == 2, err
    assert lines[0].startswith(
        "kvcli: converting the embedded model smollm2-135m-instruct for its first use (once, ~20 s) into "
    )
    assert lines[1].startswith("kvcli: error: cannot convert the embedded model")
    code, out, err = cli("ask", files["doc"], "What is it?", "--cache-dir", tmp_path / "fresh", "--quiet")
    assert code == 1 and err.startswith("kvcli: error: cannot convert") and len(err.splitlines()) == 1
