"""Which PDF text extraction reads real documents right: word counts and word overlap against poppler's
``pdftotext``, on PDFs from Debian's documentation packages (docs/bench/pdf-extraction/README.md).

    apt-get install poppler-utils debian-refcard gnuplot-doc groff python-reportlab-doc ruby-prawn-doc \\
        auto-multiple-choice-doc-pdf camlidl-doc r-doc-pdf valgrind libreoffice-writer-nogui
    pip install pypdf pdfminer.six pypdfium2
    python benchmarks/pdf_extraction.py --out docs/bench/pdf-extraction

Each PDF of ``CORPUS`` (gzipped ones are unpacked into a temporary folder) is read by every extraction
below that is installed; LibreOffice's PDFs are made here from two Debian files (``soffice
--convert-to pdf``). Words are ``\\w+`` runs after NFKC (ligatures unfolded), so punctuation does not
count; the overlap is the Dice coefficient of the two word multisets, ``2|A∩B| / (|A|+|B|)`` — words
run together ("aptupdate") are missing from both the count and the overlap. ``kvcli`` is what
:func:`kvcli.documents.load_document` reads now. No timings: the machine the table was made on was
shared (see the README for what is known of each library's speed).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import shutil
import subprocess
import sys
import tempfile
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

D = "/usr/share/doc"
# (Debian package, file): at least one PDF of every producer found in Debian's documentation
CORPUS = [
    ("debian-refcard", f"{D}/debian-refcard/refcard-en-a4.pdf.gz"),
    ("debian-refcard", f"{D}/debian-refcard/refcard-de-a4.pdf.gz"),
    ("auto-multiple-choice-doc-pdf", f"{D}/auto-multiple-choice/auto-multiple-choice.en.pdf"),
    ("auto-multiple-choice-doc-pdf", f"{D}/auto-multiple-choice/latex/automultiplechoice.pdf"),
    ("gnuplot-doc", f"{D}/gnuplot/gnuplot.pdf"),
    ("r-doc-pdf", f"{D}/r-doc-pdf/manual/R-intro.pdf"),
    ("camlidl-doc", f"{D}/camlidl/camlidl-1.04.doc.pdf"),
    ("bzip2-doc", f"{D}/bzip2/manual.pdf.gz"),
    ("groff-base", f"{D}/groff-base/examples/mom/mom-pdf.pdf.gz"),
    ("groff-base", f"{D}/groff-base/examples/mom/sample_docs.pdf.gz"),
    ("groff-base", f"{D}/groff-base/pdf/pdfmark.pdf.gz"),
    ("valgrind", f"{D}/valgrind/valgrind_manual.pdf.gz"),
    ("python-reportlab-doc", f"{D}/python-reportlab-doc/reportlab-userguide.pdf"),
    ("ruby-prawn-doc", f"{D}/ruby-prawn/manual.pdf.gz"),
]
# (Debian package, file, soffice filter): converted to PDF by LibreOffice here
LIBREOFFICE = [
    ("groff-base", f"{D}/groff-base/html/mom/typesetting.html", "pdf:writer_web_pdf_Export"),
    ("base-files", "/usr/share/common-licenses/GPL-3", "pdf"),
]


# --- the extractions: path -> list of page texts -------------------------------------------------


def pypdf_plain(path: Path) -> list[str]:
    import pypdf

    return [p.extract_text() or "" for p in pypdf.PdfReader(path).pages]


def pypdf_layout(path: Path) -> list[str]:
    import pypdf

    return [p.extract_text(extraction_mode="layout") or "" for p in pypdf.PdfReader(path).pages]


def pdfminer_six(path: Path) -> list[str]:
    from pdfminer.high_level import extract_text

    return extract_text(str(path)).split("\f")


def pypdfium2_text(path: Path) -> list[str]:
    import pypdfium2

    doc = pypdfium2.PdfDocument(str(path))
    try:
        return [doc[i].get_textpage().get_text_range() for i in range(len(doc))]
    finally:
        doc.close()


def kvcli_now(path: Path) -> list[str]:
    from kvcli.documents import load_document

    doc = load_document(path)
    ends = list(doc.page_starts[1:]) + [len(doc.text)]
    return [doc.text[a:b] for a, b in zip(doc.page_starts, ends)]


def pdftotext(path: Path) -> list[str]:
    out = subprocess.run(["pdftotext", "-enc", "UTF-8", str(path), "-"], capture_output=True, check=True)
    return out.stdout.decode("utf-8", "replace").split("\f")


EXTRACTIONS = {
    "pypdf (kvcli before)": pypdf_plain,
    "pypdf layout": pypdf_layout,
    "pdfminer.six": pdfminer_six,
    "pypdfium2": pypdfium2_text,
    "kvcli": kvcli_now,
}
REFERENCE = "pdftotext"

_WORD = re.compile(r"\w+")


def words(pages: list[str]) -> list[str]:
    return _WORD.findall(unicodedata.normalize("NFKC", "\n".join(pages)))


def overlap(a: list[str], b: list[str]) -> float:
    """Dice coefficient of the word multisets."""
    if not a and not b:
        return 1.0
    common = sum((collections.Counter(a) & collections.Counter(b)).values())
    return 2 * common / (len(a) + len(b))


def producer(path: Path) -> str:
    out = subprocess.run(["pdfinfo", str(path)], capture_output=True, text=True)
    info = dict(line.split(":", 1) for line in out.stdout.splitlines() if ":" in line)
    return " ".join(info.get("Producer", "").split()) or " ".join(info.get("Creator", "").split()) or "?"


def gather(work: Path) -> list[tuple[str, Path]]:
    files = []
    for package, src in CORPUS:
        src = Path(src)
        if not src.exists():
            print(f"skip {src} (install {package})", file=sys.stderr)
            continue
        if src.suffix == ".gz":
            (work / package).mkdir(exist_ok=True)
            dst = work / package / src.stem  # bzip2's and Prawn's are both manual.pdf
            dst.write_bytes(gzip.decompress(src.read_bytes()))
            files.append((package, dst))
        else:
            files.append((package, src))
    soffice = shutil.which("soffice")
    for package, src, export in LIBREOFFICE:
        if soffice is None or not Path(src).exists():
            print(f"skip {src} (install libreoffice-writer-nogui and {package})", file=sys.stderr)
            continue
        name = Path(src).name
        copy = work / (name if "." in name else name + ".txt")
        shutil.copy(src, copy)
        subprocess.run(
            [soffice, "--headless", "--convert-to", export, "--outdir", str(work), str(copy)],
            capture_output=True,
            timeout=300,
        )
        files.append((package, copy.with_suffix(".pdf")))
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder for results.json and table.md")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for package, path in gather(Path(tmp)):
            ref = words(pdftotext(path))
            row = {
                "file": path.name,
                "package": package,
                "producer": producer(path),
                "pages": None,
                REFERENCE: len(ref),
                "methods": {},
            }
            for name, extract in EXTRACTIONS.items():
                try:
                    pages = extract(path)
                except Exception as e:  # noqa: BLE001 - a failure is a result
                    row["methods"][name] = {"error": f"{type(e).__name__}: {e}"[:120]}
                    continue
                got = words(pages)
                row["methods"][name] = {"words": len(got), "overlap": round(overlap(got, ref), 4)}
                if name == "pypdfium2":
                    row["pages"] = len(pages)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    table = render(rows)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
        (args.out / "table.md").write_text(table)


def render(rows: list[dict]) -> str:
    names = list(EXTRACTIONS)
    head = (
        "| PDF (Debian package) | producer | pages | pdftotext words | "
        + " | ".join(f"{n}: words (overlap)" for n in names)
        + " |"
    )
    lines = [head, "|" + "---|" * (4 + len(names))]
    worst = {n: 1.0 for n in names}
    for r in rows:
        cells = []
        for n in names:
            m = r["methods"].get(n, {})
            if "error" in m:
                cells.append("error")
                worst[n] = 0.0
            else:
                cells.append(f"{m['words']:,} ({m['overlap']:.1%})")
                worst[n] = min(worst[n], m["overlap"])
        lines.append(
            f"| {r['file']} ({r['package']}) | {r['producer']} | {r['pages']} | {r[REFERENCE]:,} | "
            + " | ".join(cells)
            + " |"
        )
    lines.append("| **lowest overlap** | | | | " + " | ".join(f"**{worst[n]:.1%}**" for n in names) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
