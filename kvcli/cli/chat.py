"""``kvcli chat``: one document, many questions — the model and the document loaded once, each
question answered from the document's stored KV; a prompt with history on a terminal, one question
per line over a pipe. stdout holds the answers alone: where it is not a terminal (``kvcli chat doc
| tee log``) the prompt goes to stderr."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import typer

from .. import api, batch
from ..documents import read_stdin
from ..errors import KvcliError, UsageError
from ..files import cache_folder
from ..report.record import question_record, result_record
from .app import app
from .console import route_warnings, stderr, stdout
from .live import answer, stats_line
from .options import (
    AnswerGuardOpt,
    CacheDirOpt,
    CacheMaxOpt,
    CheckOpt,
    CompressorOpt,
    LookupOpt,
    ModelChoice,
    ModelOptions,
    NoCacheOpt,
    SourcesOpt,
    TemplateOpt,
    loads_a_model,
    max_new_tokens_option,
    sources_wanted,
    usage,
)

CHAT_HELP = """Ask questions about one document, one after another.

The model and the document are loaded once. Each question is answered from the document's KV,
stored after the first question, like a repeat kvcli ask (with --no-cache every question reads
the whole document again).

On a terminal: a prompt with line editing and history (Up and Down; kept in the cache folder),
answers printed as they are decoded, then a line of figures. Ctrl-C cancels the answer being
written, not the chat; Ctrl-D on an empty prompt leaves. With stdout not a terminal (kvcli chat
book.pdf | tee log) the prompt goes to stderr: stdout holds the answers alone.

Over a pipe (stdin not a terminal): one question per line, one answer per question on stdout
(--json: one JSON object per line, as kvcli ask's batches write them, errors as error records).

Exit code: 0; 1 when a question over a pipe failed (the others are answered); 2 usage error.

Examples:

\b
  kvcli chat book.pdf
  kvcli chat book.pdf -c snapkv:budget=0.25
  printf 'Who wrote it?\\nWhen?\\n' | kvcli chat book.pdf --json
"""

PROMPT = "> "
HISTORY_FILE = "chat_history"
HISTORY_LENGTH = 1000


@app.command(
    help=CHAT_HELP, short_help="Ask questions about one document at a prompt.", cls=usage("[OPTIONS] DOCUMENT")
)
@loads_a_model
def chat(
    document: str = typer.Argument(..., metavar="DOCUMENT", help="A .pdf, .txt, .md or .html file", show_default=False),
    compressor: str = CompressorOpt,
    load: ModelChoice = ModelOptions,
    max_new_tokens: int = max_new_tokens_option(),
    template: str = TemplateOpt,
    as_json: bool = typer.Option(
        False, "--json", help="One JSON object per answer (JSON Lines), as kvcli ask's batches"
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Nothing on stderr but errors"),
    cache_dir: Path | None = CacheDirOpt,
    no_cache: bool = NoCacheOpt,
    cache_max: str | None = CacheMaxOpt,
    answer_guard: bool = AnswerGuardOpt,
    lookup: int = LookupOpt,
    sources: bool = SourcesOpt,
    check: bool = CheckOpt,
) -> None:
    err = stderr(quiet)
    route_warnings(quiet)
    options = load.ask_options(
        max_new_tokens=max_new_tokens,
        template=template,
        cache_dir=cache_dir,
        use_cache=not no_cache,
        answer_guard=answer_guard,
        lookup=lookup,
        cache_max=cache_max,
        sources=sources is not False,
        check=check,
    )
    if document == batch.STDIN:
        raise UsageError("kvcli chat reads its questions from stdin; give the document as a file")
    pipeline = api.parse_pipeline(compressor)
    items = batch.expand_inputs([document])
    if len(items) != 1:
        raise UsageError(
            f"kvcli chat answers about one document; {document} holds {len(items):,} (kvcli ask answers about many)"
        )
    doc = batch.read_input(items[0], read_stdin, cache_folder(cache_dir))
    with err.status("loading model…", spinner="dots"):
        session = api.Session.open(options)
    if sys.stdin.isatty():
        history = cache_folder(cache_dir) / HISTORY_FILE
        _at_the_prompt(err, session, doc, pipeline, as_json, history, sources)
    elif _over_a_pipe(err, session, doc, items[0].source, pipeline, as_json, sources):
        raise typer.Exit(1)


def _output(err, session, doc, source, pipeline, question, result, as_json, streamed, shown=True) -> None:
    if as_json:
        record = question_record(source, question, result_record(result, session, pipeline, doc))
        stdout.out(json.dumps(record, ensure_ascii=False))
    elif streamed:
        sys.stdout.write("\n")
    # else: written whole once final (answer(whole=True)), before its check and sources
    if shown and not as_json and result.sources is not None:
        for line in result.sources.lines():
            stdout.out(line)
    sys.stdout.flush()
    err.print(stats_line(result, pipeline), style="dim", markup=False, highlight=False)


def _over_a_pipe(err, session, doc, source, pipeline, as_json, sources=None) -> bool:
    """One question per line of stdin; returns whether any failed. stdout in a pipe: the answers alone
    (their sources with --sources), or JSON Lines."""
    failed = False
    compute, shown = sources_wanted(sources, as_json, stdout.is_terminal)
    for line in read_stdin(lines=True):
        question = line.strip()
        if not question:
            continue
        try:
            result = answer(err, session, doc, question, pipeline, stream=False, sources=compute, whole=not as_json)
        except KvcliError as e:
            failed = True
            if as_json:
                stdout.out(json.dumps(batch.error_record(source, question, e), ensure_ascii=False))
                sys.stdout.flush()
            print(f"kvcli: error: {e}", file=sys.stderr)
            continue
        _output(err, session, doc, source, pipeline, question, result, as_json, streamed=False, shown=shown)
    return failed


def _at_the_prompt(err, session, doc, pipeline, as_json, history: Path, sources=None) -> None:
    """The interactive loop: read a question (readline: editing, history), answer it, again."""
    readline = _readline(history)
    err.print(
        f"{doc.source} · {doc.n_pages:,} page(s) · {session.lm.name} · ask a question (Ctrl-C cancels an answer, Ctrl-D leaves)",
        style="dim",
        markup=False,
        highlight=False,
    )
    stream = not as_json and stdout.is_terminal
    compute, shown = sources_wanted(sources, as_json, stdout.is_terminal)
    # stdout not a terminal (``kvcli chat doc | tee log``): it holds the answers alone; the prompt
    # and the line ending it on Ctrl-C or Ctrl-D go to stderr (input() would write them to stdout)
    screen = sys.stdout if stdout.is_terminal else sys.stderr
    idle = Idle(session)
    try:
        while True:
            try:
                question = _question(stdout.is_terminal)
            except EOFError:  # Ctrl-D
                screen.write("\n")
                return
            except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh prompt, as a shell does
                screen.write("\n")
                continue
            if not question.strip():
                continue
            idle.stop()  # the question runs alone
            try:
                result = answer(
                    err, session, doc, question, pipeline, stream, sources=compute, whole=not (as_json or stream)
                )
            except KeyboardInterrupt:
                err.print("(answer cancelled)", style="dim", markup=False, highlight=False)
                continue
            except KvcliError as e:
                print(f"kvcli: error: {e}", file=sys.stderr)
                continue
            _output(err, session, doc, doc.source, pipeline, question, result, as_json, streamed=stream, shown=shown)
            idle.start(result)
    finally:
        idle.stop()
        if readline is not None:
            try:
                history.parent.mkdir(parents=True, exist_ok=True)
                readline.write_history_file(str(history))
            except OSError:
                pass  # a read-only cache folder: no history next time


class Idle:
    """A chat's idle time put to use: after an answer whose reading ranked the pages with a
    sentence-embedding model, the rest of the document's pages are embedded in a thread while the
    user reads and types (:meth:`kvcli.api.Session.embed_rest`), and stopped, within one small step,
    before the next question runs: a later question then finds its candidates embedded instead of
    embedding them first (a 236-page manual, 30 s between questions: the later ones 2-9 s sooner on
    two cores; docs/bench/retrieval). Nothing is printed from the thread; what it fails at, the next
    question does again."""

    def __init__(self, session) -> None:
        self.session = session
        self.thread: threading.Thread | None = None
        self.halt = threading.Event()
        self.written: Path | None = None

    def start(self, result) -> None:
        self.stop()
        self.halt, self.written = threading.Event(), None

        def run() -> None:
            try:
                self.written = self.session.embed_rest(result, self.halt)
            except Exception:  # noqa: BLE001 - nothing is lost: the next question embeds what it needs
                self.written = None

        self.thread = threading.Thread(target=run, name="kvcli-idle-embedding", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Stop the thread (after its step) and make room under the cache's cap for what it wrote."""
        if self.thread is None:
            return
        self.halt.set()
        self.thread.join()
        self.thread = None
        if self.written is not None:
            self.session.made(self.written)


def _question(on_stdout: bool) -> str:
    """A line typed at the prompt: ``input(PROMPT)`` when stdout is a terminal (readline's editing);
    else the prompt is written to stderr, so that stdout holds only the answers."""
    if on_stdout:
        return input(PROMPT)
    sys.stderr.write(PROMPT)
    sys.stderr.flush()
    return input()


def _readline(history: Path):
    """The readline module with the chat's history loaded (None where Python has none)."""
    try:
        import readline
    except ImportError:  # pragma: no cover - Windows
        return None
    readline.set_history_length(HISTORY_LENGTH)
    try:
        readline.read_history_file(str(history))
    except OSError:
        pass  # none yet
    return readline
