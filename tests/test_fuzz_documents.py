"""Fuzz-style: random bytes, truncated and corrupted PDFs and odd encodings through the document
loaders and through ``python -m kvcli ask``. Every case is a clean read or one line and a
non-zero exit, never a traceback, never a hang: each case has a time limit (issue 27)."""

from __future__ import annotations

import codecs
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # every case runs in a child process (python -c, python -m kvcli ask)

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"
CASE_SECONDS = 20  # per case; the loaders take well under a second on each


def _fpdf_bytes() -> bytes:
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_font("Helvetica", size=12)
    for text in ("The harbour is blue.", "The passkey is 71432."):
        pdf.add_page()
        pdf.multi_cell(0, 8, text)
    return bytes(pdf.output())


def cases() -> list[tuple[str, bytes]]:
    """(file name, bytes): the same every run (seeded)."""
    rng = random.Random(27)
    out: list[tuple[str, bytes]] = []
    for size in (0, 1, 7, 300, 5000):
        for suffix in (".pdf", ".txt", ".md", ".html"):
            out.append((f"random-{size}{suffix}", rng.randbytes(size)))
    high = high_bytes(5, 3000)
    out += [("high-bytes.txt", high), ("high-bytes.html", high)]
    for name, data in (("refcard", (DATA / "refcard-en-a4.pdf").read_bytes()), ("fpdf", _fpdf_bytes())):
        for cut in (5, 9, 100, len(data) // 3, len(data) // 2, len(data) - 200, len(data) - 30, len(data) - 1):
            out.append((f"{name}-cut-{cut}.pdf", data[:cut]))
        for i in range(6):  # a few bytes overwritten: a damaged file PDFium may or may not repair
            damaged = bytearray(data)
            for _ in range(1 + i * 4):
                damaged[rng.randrange(len(damaged))] = rng.randrange(256)
            out.append((f"{name}-damaged-{i}.pdf", bytes(damaged)))
        out.append((f"{name}-prefixed.pdf", b"\x00" * 64 + data))
    text = "The keeper's café — «Ångström» 灯台 منارة\nsecond line\n"
    out += [
        ("utf16-le-bom.txt", codecs.BOM_UTF16_LE + text.encode("utf-16-le")),
        ("utf16-be-bom.md", codecs.BOM_UTF16_BE + text.encode("utf-16-be")),
        ("utf16-no-bom.txt", text.encode("utf-16-le")),
        ("utf16-odd-length.txt", codecs.BOM_UTF16_LE + text.encode("utf-16-le")[:-1]),
        ("utf32.txt", text.encode("utf-32")),
        ("utf8-bom.txt", codecs.BOM_UTF8 + text.encode()),
        ("only-bom.txt", codecs.BOM_UTF8),
        ("shift-jis.txt", "灯台の守り人は三人いた。".encode("shift_jis")),
        ("gb18030.txt", "灯塔看守人有三个。".encode("gb18030")),
        ("cp1252.txt", "“Smart quotes” – and a café.".encode("cp1252")),
        ("koi8-r.txt", "Смотритель маяка.".encode("koi8_r")),
        ("bad-utf8.txt", b"valid start \xc3\x28 \xa0\xa1 \xed\xa0\x80 \xf0\x28\x8c\x28 end"),
        ("crlf-cr.md", b"one\r\ntwo\rthree\n\n\n\n\nfour"),
        ("whitespace.txt", b" \t\n\r\n  \x0c \n"),
        ("zero-width.txt", "a\u200bb\u200dc\ufeffd".encode()),
        ("one-long-line.txt", b"word " * 40000),
        (
            "html-broken.html",
            b"<html><body><p>open <b>bold <i>both</p></div></span><script>var x = '</p>';</script>tail",
        ),
        ("html-nul.html", b"<html><body>\x00\x00<p>text</p></body></html>"),
        ("html-entities.html", b"<p>&amp;&lt;&#x1F600;&#0;&#xD800;&bogus;&#99999999;</p>"),
        ("html-empty.htm", b"<html><head><title>only a title</title></head><body><script>x()</script></body></html>"),
    ]
    return out


# A child process reads every case and prints one JSON line per case, so that the parent can
# bound the time of each (the line says where it hung) without a process per case.
CHILD = r"""
import json, sys, time
from pathlib import Path
from kvcli.documents import load_document
from kvcli.errors import DocumentError
for path in sys.argv[1:]:
    print(json.dumps({"start": path}), flush=True)
    t0 = time.monotonic()
    try:
        doc = load_document(path)
    except DocumentError as e:
        out = {"error": str(e)}
    except BaseException as e:  # a bug: reported, the test fails on it
        out = {"crash": f"{type(e).__name__}: {e}"}
    else:
        ends = list(doc.page_starts[1:]) + [len(doc.text)]
        out = {"pages": doc.n_pages, "chars": len(doc.text), "ok_map": all(doc.page_of(a) == i + 1 for i, a in enumerate(doc.page_starts) if a < len(doc.text)), "empty": not doc.text.strip()}
    out.update(path=path, seconds=time.monotonic() - t0)
    print(json.dumps(out), flush=True)
"""


def _run_child(paths: list[Path]) -> tuple[list[dict], str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, *map(str, paths)],
            env=env,
            capture_output=True,
            text=True,
            timeout=CASE_SECONDS * len(paths),
        )
    except subprocess.TimeoutExpired as e:
        lines = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        started = [json.loads(line)["start"] for line in lines.splitlines() if '"start"' in line]
        pytest.fail(f"the loaders hung on {started[-1] if started else '?'}")
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if '"start"' not in line], proc.stderr


def test_fuzzed_documents_are_read_cleanly_or_refused_in_one_line(tmp_path):
    paths = []
    for name, data in cases():
        path = tmp_path / name
        path.write_bytes(data)
        paths.append(path)
    results, stderr = _run_child(paths)
    assert stderr == ""  # nothing printed by a library (PDFium, pypdf's old warnings)
    assert [r["path"] for r in results] == [str(p) for p in paths]
    for r in results:
        name = Path(r["path"]).name
        assert "crash" not in r, r
        assert r["seconds"] < CASE_SECONDS, r
        if "error" in r:
            assert "\n" not in r["error"] and name in r["error"], r
        else:
            assert r["ok_map"] and not r["empty"], r
    by_name = {Path(r["path"]).name: r for r in results}
    # what must be refused, and what must be read
    for name in (
        "random-5000.txt",
        "random-5000.md",
        "random-5000.html",
        "high-bytes.txt",
        "high-bytes.html",
        "html-nul.html",
        "random-5000.pdf",
    ):
        assert "error" in by_name[name], by_name[name]
    for name in (
        "utf16-le-bom.txt",
        "utf16-be-bom.md",
        "utf16-no-bom.txt",
        "utf8-bom.txt",
        "cp1252.txt",
        "crlf-cr.md",
        "one-long-line.txt",
        "html-broken.html",
        "refcard-prefixed.pdf",
    ):
        assert "error" not in by_name[name], by_name[name]
    assert "is empty" in by_name["whitespace.txt"]["error"] and "is empty" in by_name["only-bom.txt"]["error"]


def high_bytes(seed: int, n: int) -> bytes:
    """``n`` random bytes of 0x80-0xFF: no NUL, no ASCII (Latin-1's C1 controls among them)."""
    rng = random.Random(seed)
    return bytes(rng.randrange(0x80, 0x100) for _ in range(n))


# (file name, bytes, what the one error line says) through the real command
CLI_CASES = [
    ("random.txt", random.Random(1).randbytes(20000), "is not text"),
    ("truncated.pdf", (DATA / "refcard-en-a4.pdf").read_bytes()[:2000], "is not a valid PDF"),
    ("empty.md", b"", "is empty"),
    ("high.html", high_bytes(2, 4000), "is not text"),
]


@pytest.mark.parametrize("name, data, needle", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_fuzzed_documents_through_kvcli_ask_end_in_one_line(tmp_path, tiny_dir, name, data, needle):
    path = tmp_path / name
    path.write_bytes(data)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    model = str(tiny_dir("llama", num_hidden_layers=4))  # a document read by mistake stays quick
    proc = subprocess.run(
        [sys.executable, "-m", "kvcli", "ask", str(path), "What is this?", "-m", model, "--max-new-tokens", "2", "--no-cache"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1 and proc.stdout == "", proc
    [line] = proc.stderr.splitlines()
    assert line.startswith("kvcli: error: ") and needle in line and name in line, line


@pytest.mark.parametrize("encoding", [None, "utf-8:strict"])
def test_binary_on_stdin_through_kvcli_ask_ends_in_one_line(tmp_path, tiny_dir, encoding):
    """Refused in one line whatever the locale makes of stdin: ``utf-8:strict`` is what a regular
    UTF-8 locale (en_US.UTF-8) gives, where C and C.UTF-8 keep undecodable bytes as surrogates."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if encoding:
        env["PYTHONIOENCODING"] = encoding
    model = str(tiny_dir("llama", num_hidden_layers=4))
    for data in (random.Random(3).randbytes(5000), high_bytes(4, 5000)):
        args = [sys.executable, "-m", "kvcli", "ask", "-", "What?", "-m", model, "--max-new-tokens", "2", "--no-cache"]
        proc = subprocess.run(args, input=data, env=env, capture_output=True, timeout=120)
        assert proc.returncode == 1 and proc.stdout == b"", proc
        [line] = proc.stderr.decode().splitlines()
        assert line.startswith("kvcli: error: stdin is not text"), line


def test_a_document_with_odd_encoding_is_answered_by_kvcli_ask(tmp_path, tiny_dir):
    """A clean read goes all the way: a UTF-16 file with a BOM, answered by a tiny model."""
    path = tmp_path / "utf16.txt"
    path.write_bytes(codecs.BOM_UTF16_LE + "The keeper's café is blue.\n".encode("utf-16-le"))
    model = str(tiny_dir("llama", num_hidden_layers=4))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "kvcli", "ask", str(path), "What colour?", "-m", model, "--max-new-tokens", "2", "--no-cache", "--json", "-q"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    record = json.loads(proc.stdout)
    assert record["n_document_tokens"] > 0 and isinstance(record["answer"], str)
