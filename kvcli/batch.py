"""Many documents, many questions, one model: what ``kvcli ask`` does with folders and ``--questions``.

    from kvcli.batch import expand_inputs, read_questions
    from kvcli.executors import run_batch
    for record in run_batch(session, expand_inputs(["contracts/"]), ["Who are the parties?"], pipeline):
        print(record)          # one dict per (document, question) pair, in a stable order

Inputs are files, folders (searched recursively for supported extensions, sorted), glob patterns
(for when the shell did not expand them) and ``-`` (the document text on stdin). A document that
cannot be read, or a question that fails, yields an *error record* — ``{"document", "question",
"error", "error_type"}`` — and the batch goes on (unless ``fail_fast``). The model is loaded once
(the caller's :class:`~kvcli.api.Session`) and the disk KV store is shared by every question, so
the questions about one document reuse its prefix state.

One code path makes the records: :meth:`Work.records` answers every question of one document
(a :class:`Job`). Where it runs is an executor's choice (:mod:`kvcli.executors`: this process, or
the actors of a Ray cluster); :func:`run_batch` puts what executors report back in input order.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .documents import SUPPORTED_SUFFIXES, Document, document_from_text, load_document, read_stdin
from .errors import DocumentError, KvcliError, UsageError
from .files import cache_folder

STDIN = "-"


@dataclass(frozen=True)
class Input:
    """One document to read: a path, ``-`` for stdin, or a pattern/folder that matched nothing."""

    source: str
    problem: str | None = None  # set when the input named no document (reported as an error record)


def expand_inputs(inputs: list[str]) -> list[Input]:
    """Files as given, folders recursively (supported extensions, sorted), globs expanded (sorted).

    Nothing is read here; a missing file stays in the list and fails when it is read.
    """
    out: list[Input] = []
    for raw in inputs:
        if raw == STDIN:
            out.append(Input(STDIN))
            continue
        path = Path(raw).expanduser()
        if path.is_dir():
            found = sorted(
                p
                for p in path.rglob("*")
                if p.is_file() and p.suffix.lower() in SUPPORTED_SUFFIXES and not _hidden(p, path)
            )
            if not found:
                out.append(Input(raw, f"{raw}: no {', '.join(SUPPORTED_SUFFIXES)} files in this folder"))
            out.extend(Input(str(p)) for p in found)
        elif not path.exists() and glob.has_magic(raw):
            found = sorted(p for p in glob.glob(os.path.expanduser(raw), recursive=True) if Path(p).is_file())
            if not found:
                out.append(Input(raw, f"{raw}: no files match this pattern"))
            out.extend(Input(p) for p in found)
        else:
            out.append(Input(raw))
    return out


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def read_questions(path: str) -> list[str]:
    """Questions from a file (``-``: stdin): one per line, or JSON Lines with a "question" field
    (or a JSON string per line). Blank lines and lines starting with ``#`` are skipped."""
    try:
        text = read_stdin() if path == STDIN else Path(path).expanduser().read_text(encoding="utf-8")
        text.encode("utf-8")  # stdin's bytes that are not UTF-8 (lone surrogates) refused as a file's are
    except FileNotFoundError:
        raise UsageError(f"--questions: {path} does not exist") from None
    except UnicodeEncodeError:
        raise UsageError(f"--questions: cannot read {path}: it is not UTF-8 text") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--questions: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    questions = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line[0] in '{"':
            try:
                value = json.loads(line)
            except ValueError:
                raise UsageError(f"--questions: line {n} of {path} is not valid JSON") from None
            if isinstance(value, dict):
                value = value.get("question")
            if not isinstance(value, str) or not value.strip():
                raise UsageError(f'--questions: line {n} of {path} has no "question" string')
            line = value.strip()
        questions.append(line)
    if not questions:
        raise UsageError(f"--questions: {path} has no questions")
    return questions


def looks_like_question(arg: str) -> bool:
    """True when a command-line input names no document: not ``-``, not an existing file or folder,
    not a pattern that matches files, and without a document's extension (``'Extra?'``, not
    ``'notes/*.pdf'`` or a missing ``report.pdf``, which are reported as unreadable documents)."""
    if arg == STDIN:
        return False
    path = Path(arg).expanduser()
    if path.exists() or path.suffix.lower() in SUPPORTED_SUFFIXES:
        return False
    return not (glob.has_magic(arg) and glob.glob(os.path.expanduser(arg), recursive=True))


def check_question(question: str) -> str:
    """The question as given, or a usage error when it is empty."""
    if not question.strip():
        raise UsageError("the question is empty")
    return question


def error_line(record: dict) -> str:
    """An error record as one line that names its document once: the message when it names the
    document already (document errors do), else ``document: message``."""
    source, message = record["document"], record["error"]
    named = "stdin" if source == STDIN else source
    return message if named in message else f"{named}: {message}"


class ErrorLines:
    """What a batch says on stderr about its error records: each document's error once (a
    document that cannot be read fails every question, with one record per pair in the JSON)."""

    def __init__(self) -> None:
        self._said: set[tuple[str, str]] = set()

    def line(self, record: dict) -> str | None:
        """The record's one line (:func:`error_line`), or None when it was said already."""
        key = (record["document"], record["error"])
        if key in self._said:
            return None
        self._said.add(key)
        return error_line(record)


def read_input(item: Input, stdin_text: Callable[[], str], cache_dir: Path | None = None) -> Document:
    """The input's document; ``cache_dir``: where an extracted text is kept (:func:`load_document`)."""
    if item.problem is not None:
        raise DocumentError(item.problem)
    if item.source == STDIN:
        return document_from_text(stdin_text(), source=STDIN)
    return load_document(item.source, cache_dir)


def error_record(source: str, question: str, exc: BaseException) -> dict:
    if isinstance(exc, KvcliError):
        message, kind = str(exc), type(exc).__name__
    else:  # a bug: still one record, and the batch goes on
        message, kind = f"internal error: {type(exc).__name__}: {exc}", "InternalError"
    return {"document": source, "question": question, "error": message, "error_type": kind}


@dataclass(frozen=True)
class Job:
    """One document of a batch, the unit an executor places on a worker: all of its questions run
    there, in order, so questions 2..n reuse the prefix state the first one computed."""

    index: int  # its place in the input list (the output's order)
    item: Input
    text: str | None = None  # stdin's text, read where the batch started (a worker has no stdin)

    def read(self, stdin_text: Callable[[], str], cache_dir: Path | None = None) -> Document:
        return read_input(self.item, (lambda: self.text) if self.text is not None else stdin_text, cache_dir)


@dataclass(frozen=True)
class Work:
    """What every document of a batch is asked, and how: the one code path that makes records,
    wherever an executor runs it (this process, a Ray actor)."""

    questions: tuple[str, ...]
    pipeline: object  # kvcli.answer.pipeline.Pipeline (as parsed: picklable)
    include_spans: bool = False
    fail_fast: bool = False

    def records(
        self,
        session,
        job: Job,
        on_start: Callable[[str, str], None] | None = None,
        stdin_text: Callable[[], str] = read_stdin,
    ) -> Iterator[dict]:
        """The records of one document: one per question, in order (with ``fail_fast``, up to the
        first error record)."""
        from .report.record import question_record, result_record

        source = job.item.source
        try:
            document = job.read(stdin_text, cache_folder(session.options.cache_dir))
        except Exception as exc:  # noqa: BLE001 - every failure becomes a record
            yield from self.error_records(source, exc)
            return
        for question in self.questions:
            if on_start is not None:
                on_start(source, question)
            try:
                result = session.ask(document, question, self.pipeline)
            except Exception as exc:  # noqa: BLE001
                yield error_record(source, question, exc)
                if self.fail_fast:
                    return
                continue
            record = result_record(result, session, self.pipeline, document, include_spans=self.include_spans)
            yield question_record(source, question, record)

    def error_records(self, source: str, exc: BaseException) -> Iterator[dict]:
        """A document that failed as a whole (``exc``): one error record per question (with
        ``fail_fast``, the first only)."""
        for question in self.questions:
            yield error_record(source, question, exc)
            if self.fail_fast:
                return
