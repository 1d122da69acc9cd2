"""``kvcli cache``: the disk KV cache — list, show, remove, prune; the retrieval's page vectors
(``<cache_dir>/vectors``) and documents' extracted texts (``<cache_dir>/texts``) are part of it:
entries of kind "vectors" and "text"."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import typer

from ..errors import KvcliError, UsageError
from ..report import terminal as render
from ..store import parse_size, resolve_cap
from ..store.capacity import CAP_ENV
from . import vocabulary
from .app import app
from .console import stdout
from .options import CompressorOpt, KvcliCommand, ModelChoice, ModelOptions, QuietOpt, TemplateOpt, loads_a_model

cache_app = typer.Typer(
    no_args_is_help=True,
    short_help="The disk KV cache: list, show, remove, prune; ready a document ahead.",
    help="The disk KV cache: what kvcli kept of earlier documents so later questions are fast "
    "(their KV, the page vectors the pages method retrieves with, and PDFs' and HTML pages' extracted text).",
)
app.add_typer(cache_app, name="cache")

CacheDir = typer.Option(
    None,
    "--cache-dir",
    envvar=vocabulary.env("KVCLI_CACHE_DIR"),
    help="The cache directory (default: $XDG_CACHE_HOME/kvcli)",
)


def _given_from_env(name: str, value: str) -> bool:
    """Whether ``value`` is just ``$name`` (an explicit old-named option wins over the environment)."""
    return os.environ.get(name) == value


def _open_cache(cache_dir: Path | None):
    """The store of ``cache_dir`` (default: the user's), with a warning when that folder is not there:
    a mistyped --cache-dir would otherwise look like an empty cache."""
    from .. import api  # the library: not for --help
    from ..files import cache_folder

    folder = cache_folder(cache_dir)
    if not folder.exists():
        print(f"kvcli: warning: the cache folder {folder} does not exist; nothing is cached there", file=sys.stderr)
    elif not folder.is_dir():
        print(f"kvcli: warning: {folder} is not a folder; nothing is cached there", file=sys.stderr)
    return api.open_store(cache_dir)


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n:,} {word if n == 1 else plural or word + 's'}"


def _match_key(entries, key: str) -> list:
    """The entry whose key starts with ``key`` ([] when none does); a usage error for an empty,
    malformed or ambiguous key, so that a partial key never removes more than one entry."""
    k = key.strip().lower()
    if not k:
        raise UsageError("empty cache key; give an entry's key or its first characters (see 'kvcli cache ls')")
    if not re.fullmatch(r"[0-9a-f]+", k):
        raise UsageError(f"'{key}' is not a cache key: keys are hex digits (see 'kvcli cache ls')")
    matches = [e for e in entries if e.key.startswith(k)]
    if len(matches) > 1:
        raise UsageError(f"key '{key}' matches {len(matches)} cache entries; give more of its characters")
    return matches


@cache_app.command("path", cls=KvcliCommand)
def cache_path(cache_dir: Path | None = CacheDir) -> None:
    """Print the folder the KV cache entries live in."""
    from .. import api

    stdout.out(str(api.open_store(cache_dir).root))


@cache_app.command("ls", cls=KvcliCommand)
def cache_ls(
    cache_dir: Path | None = CacheDir,
    as_json: bool = typer.Option(False, "--json", help="One JSON object per entry (JSON Lines)"),
) -> None:
    """List the entries, most recently used first.

    Each entry's key, document, model, method, state, tokens, size and last use; a document's page
    vectors (what the pages method retrieves with) are entries of their own, of kind "vectors"
    (state "vectors", the embedding model as their model), and so is the extracted text of a PDF or
    an HTML page, of kind "text" (method "extracted text"). On a terminal: a table; piped:
    tab-separated values with a header row (full keys and paths, sizes in bytes, the kind last);
    --json: JSON Lines.
    """
    store = _open_cache(cache_dir)
    entries = store.entries()
    if as_json:
        for e in entries:
            stdout.out(json.dumps(e.to_json(), ensure_ascii=False))
    elif stdout.is_terminal:
        render.cache_table(stdout, entries, store.leftovers(), store.reclaimed)
    else:
        sys.stdout.write(render.cache_tsv(entries))


@cache_app.command("info", cls=KvcliCommand)
def cache_info(
    key: str | None = typer.Argument(
        None, metavar="[KEY]", help="An entry's key (or its first characters); none: totals", show_default=False
    ),
    cache_dir: Path | None = CacheDir,
) -> None:
    """Show the totals of the cache, or one entry's metadata, as JSON.

    The totals count every file of the store: entries (the page vectors' files among them, also
    counted as "vectors", and the extracted texts' as "texts"), temporary files of writes in progress and
    lock files held by running kvcli processes; "reclaimed_*" is what runs killed half-way had
    left (temporary files whose writer is gone, lock files nobody holds), removed just now;
    "evicts_next" is the entry the cap removes first when a new one needs room; "partial" counts the
    book reads that stopped, kept for the next read to resume ("kvcli cache ls" shows how far each got).
    """
    store = _open_cache(cache_dir)
    entries = store.entries()
    if key is None:
        left = store.leftovers()
        size = sum(e.size for e in entries)
        cap = resolve_cap(None, store.root.parent)  # the cap kvcli ask/chat enforce (None: none)
        evicts = store.next_evicted(entries)
        info = {
            "path": str(store.root),
            "entries": len(entries),
            "size_bytes": size,
            "vectors": sum(1 for e in entries if e.kind == "vectors"),  # page vectors' files (among the entries)
            "vectors_bytes": sum(e.size for e in entries if e.kind == "vectors"),
            "texts": sum(1 for e in entries if e.kind == "text"),  # extracted texts' files (among the entries)
            "texts_bytes": sum(e.size for e in entries if e.kind == "text"),
            "damaged": sum(1 for e in entries if e.error),
            "partial": sum(1 for e in entries if e.partial),  # book reads that stopped (resumed by the next)
            "writes_in_progress": left.temp_files,
            "in_progress_bytes": left.temp_bytes,
            "lock_files": left.lock_files,
            "disk_bytes": size + left.temp_bytes,
            "max_bytes": cap,
            "room_bytes": None if cap is None else max(0, cap - size),  # what a new entry takes before any goes
            # the entry the cap removes first when a new one needs room (the least recently used)
            "evicts_next": None
            if evicts is None
            else {k: evicts.to_json()[k] for k in ("key", "document", "size_bytes", "last_use")},
            "reclaimed_temp_files": store.reclaimed.temp_files,
            "reclaimed_bytes": store.reclaimed.temp_bytes,
            "reclaimed_lock_files": store.reclaimed.lock_files,
        }
        stdout.out(json.dumps(info, indent=1))
        return
    matches = _match_key(entries, key)
    if not matches:
        raise KvcliError(f"no cache entry has key '{key}' (see 'kvcli cache ls')")
    stdout.out(json.dumps({**matches[0].to_json(), "metadata": matches[0].meta}, indent=1, ensure_ascii=False))


@cache_app.command("rm", cls=KvcliCommand)
def cache_rm(
    documents: list[Path] | None = typer.Argument(
        None,
        metavar="[DOCUMENT]...",
        help="Remove the entries of these documents (by path, or by text if the file moved)",
        show_default=False,
    ),
    key: list[str] | None = typer.Option(
        None, "--key", help="Remove the entry with this key (or an unambiguous prefix of it); repeatable"
    ),
    all_entries: bool = typer.Option(False, "--all", help="Remove every entry"),
    cache_dir: Path | None = CacheDir,
) -> None:
    """Remove entries (a document's KV, page vectors and extracted text) by document, by key, or all of them.

    Exit code 1 when a document or key named no entry (the others are removed).
    """
    if not documents and not key and not all_entries:
        raise UsageError("cache rm: name documents, --key KEY or --all")
    if all_entries and (documents or key):
        raise UsageError("cache rm: --all removes every entry; give it without documents or --key")
    from .. import api

    store = _open_cache(cache_dir)
    entries = store.entries()
    chosen, unmatched = [], []
    if all_entries:
        chosen = entries
    for k in key or []:  # every key checked (empty, malformed, ambiguous) before anything is removed
        matches = _match_key(entries, k)
        chosen += [e for e in matches if e not in chosen]
        if not matches:
            unmatched.append(f"key '{k}'")
    for doc in documents or []:
        matches = api.entries_for_documents(store, [doc])
        chosen += [e for e in matches if e not in chosen]
        if not matches:
            unmatched.append(f"'{doc}'")
    freed = store.remove(chosen)
    running = [e for e in chosen if e.path.exists()]  # partial entries whose read runs stay
    if chosen or all_entries:
        line = f"removed {_plural(len(chosen) - len(running), 'entry', 'entries')}, {render.human_bytes(freed)}"
        if running:
            left = _plural(len(running), "partial entry", "partial entries")
            line += f"; left {left} another kvcli process is reading into"
        if all_entries:
            left = store.reclaim(explicit=True)
            temps, temp_bytes = (
                store.reclaimed.temp_files + left.temp_files,
                store.reclaimed.temp_bytes + left.temp_bytes,
            )
            if temps:
                line += (
                    f"; reclaimed {_plural(temps, 'temporary file')} of killed runs, {render.human_bytes(temp_bytes)}"
                )
        stdout.out(line)
    if unmatched:
        raise KvcliError(f"no cache entries for {', '.join(unmatched)} (see 'kvcli cache ls')")


@cache_app.command("prune", cls=KvcliCommand)
def cache_prune(
    cache_max: str | None = typer.Option(
        None,
        "--cache-max",
        envvar=vocabulary.env(CAP_ENV),
        help="Keep at most this much, e.g. 500M or 2G; least recently used go first (the cap ask and chat keep)",
        show_default=False,
    ),
    max_size: str | None = typer.Option(None, "--max-size", hidden=True),  # the old name, for one release
    cache_dir: Path | None = CacheDir,
    quiet: bool = QuietOpt,
) -> None:
    """Remove the least recently used entries (page vectors included) down to --cache-max.

    Also removes what runs killed half-way left behind: temporary files whose writer is gone and
    lock files nobody holds.
    """
    if max_size is not None:
        vocabulary.renamed("--max-size", quiet)
        cache_max = max_size if cache_max is None or _given_from_env(CAP_ENV, cache_max) else cache_max
    if cache_max is None:
        raise UsageError("give the size to keep: kvcli cache prune --cache-max 2G (see 'kvcli cache prune --help')")
    limit = parse_size(cache_max, CAP_ENV if _given_from_env(CAP_ENV, cache_max) else "--cache-max")
    store = _open_cache(cache_dir)
    removed, left = store.prune(limit)
    temps = store.reclaimed.temp_files + left.temp_files
    temp_bytes = store.reclaimed.temp_bytes + left.temp_bytes
    line = f"removed {_plural(len(removed), 'entry', 'entries')}, {render.human_bytes(sum(e.size for e in removed))}"
    if temps:
        line += f"; reclaimed {_plural(temps, 'temporary file')} of killed runs, {render.human_bytes(temp_bytes)}"
    stdout.out(f"{line}; {render.human_bytes(store.total_bytes())} left")


@cache_app.command("add", cls=KvcliCommand)
@loads_a_model
def cache_add(
    documents: list[str] = typer.Argument(
        ...,
        metavar="DOCUMENT...",
        help="Files, folders (searched for PDF, text, Markdown and HTML files), glob patterns, or - (stdin)",
        show_default=False,
    ),
    kv: bool = typer.Option(
        False,
        "--kv",
        help="Also read each document with the model (-m) and keep its KV, where the method (-c) reads it the same "
        "way for every question (full attention: what -c auto reads a document that fits with)",
    ),
    compressor: str = CompressorOpt,
    load: ModelChoice = ModelOptions,
    template: str = TemplateOpt,
    cache_dir: Path | None = CacheDir,
    as_json: bool = typer.Option(False, "--json", help="One JSON object per document (JSON Lines) on stdout"),
    quiet: bool = QuietOpt,
) -> None:
    """Ready documents for their questions: every page embedded ahead, and with --kv their KV.

    The pages method (what -c auto reads a long document with) ranks a document's pages by the
    question with a sentence-embedding model, and embeds the pages a question points to that no
    earlier question did: seconds of each question's wait on a book. This embeds them all now, so
    that a later question, in any process, embeds only itself; a PDF's or an HTML page's extracted
    text is kept too. Without --kv it loads no language model: a document that the default reads
    whole keeps its KV on its first question. With --kv that first question starts from the kept
    KV too, as a later one does (the same -m, -c and model options as the questions'; a method that
    reads what the question points to, pages, keeps none). Exit code: 0 all kept, 1 some could not
    be read.
    """
    from .. import api, batch
    from ..documents import read_stdin
    from ..files import cache_folder
    from .console import batch_progress, route_warnings, say_error
    from .console import stderr as progress_console

    route_warnings(quiet)
    err = progress_console(quiet)
    folder = cache_folder(cache_dir)
    pipeline = api.parse_pipeline(compressor) if kv else None  # a bad spec: one line before anything is read
    session = None
    failed = 0
    progress = batch_progress(err)
    with progress:
        for item in batch.expand_inputs(documents):
            name = "stdin" if item.source == batch.STDIN else Path(item.source).name
            task = progress.add_task(f"{name}: reading", total=None)
            try:
                document = batch.read_input(item, read_stdin, folder)
                unit = "pages" if len(document.page_starts) > 1 else "passages"

                def on_step(done: int, total: int, task=task, unit=unit) -> None:
                    progress.update(task, description=f"{name}: embedding the {unit}", completed=done, total=total)

                kept = api.keep_document(document, folder, on_step=on_step)
                kept_kv = None
                if kv:
                    if session is None:
                        progress.update(task, description="loading model…")
                        session = api.Session.open(load.ask_options(template=template, cache_dir=folder))
                    kept_kv = session.keep_kv(document, pipeline, _kv_progress(progress, task, name))
            except KvcliError as exc:
                failed += 1
                record = batch.error_record(item.source, "", exc)
                say_error(progress.console, batch.error_line(record))
                if as_json:
                    stdout.out(json.dumps({k: v for k, v in record.items() if k != "question"}, ensure_ascii=False))
                continue
            finally:
                progress.remove_task(task)
            if as_json:
                stdout.out(json.dumps(_kept_record(kept, item.source, unit, kv, kept_kv), ensure_ascii=False))
            line = _kept_line(kept, name, unit) + ("" if not kv else f"; {_kv_line(kept_kv)}")
            progress.console.print(f"kvcli: {line}", markup=False, highlight=False)
    if failed:
        raise typer.Exit(1)


def _kv_progress(progress, task, name: str):
    """The question options that show ``Session.keep_kv`` reading a document on ``task``."""
    from ..answer.question import QuestionOptions

    def prompt(method: str, n_tokens: int) -> None:
        progress.update(task, description=f"{name}: {method} · {n_tokens:,} tokens", completed=0, total=1)

    def wait(text: str | None) -> None:
        if text is not None:
            progress.update(task, description=f"{name}: {text}")

    return QuestionOptions(
        on_prompt=prompt, on_progress=lambda f: progress.update(task, completed=f, total=1), on_wait=wait
    )


def _kv_line(kept_kv) -> str:
    """ "its KV kept (full, 1,003 tokens, 8 s)" """
    if kept_kv is None:
        return "no KV kept: the disk cache is off"
    if not kept_kv.tokens:
        name = kept_kv.method.split(":")[0]
        how = "reads what each question points to" if kept_kv.retrieves else "reads the document with each question"
        return f"no KV to keep: {name} {how}"
    done = "there already" if kept_kv.status == "hit" else f"{kept_kv.seconds:,.0f} s"
    return f"its KV kept ({kept_kv.method}, {kept_kv.tokens:,} tokens, {done})"


def _kept_record(kept, source: str, unit: str, kv: bool = False, kept_kv=None) -> dict:
    kv_fields = {}
    if kv:
        kv_fields = {"kv": None if kept_kv is None else {
            "method": kept_kv.method,
            "tokens": kept_kv.tokens,
            "status": kept_kv.status,
            "seconds": round(kept_kv.seconds, 3),
        }}  # fmt: skip
    return {
        **kv_fields,
        "document": source,
        "unit": unit,
        "passages": kept.passages,
        "embedded": kept.embedded,
        "added": kept.added,
        "embedding_model": kept.model,
        "vectors": None if kept.vectors is None else str(kept.vectors),
        "seconds": round(kept.seconds, 3),
    }


def _kept_line(kept, name: str, unit: str) -> str:
    """ "R-exts.pdf: 236 of 236 pages embedded (206 now, 84 s) by embeddinggemma-300m" """
    if kept.model is None:
        return f"{name}: no sentence-embedding model is set (KVCLI_EMBED_MODEL=none): nothing to embed"
    now = f"{kept.added:,} now, {kept.seconds:,.0f} s" if kept.added else "all there already"
    return f"{name}: {kept.embedded:,} of {_plural(kept.passages, unit[:-1])} embedded ({now}) by {kept.model}"
