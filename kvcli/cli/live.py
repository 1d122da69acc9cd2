"""What the answering commands (``ask``, ``chat``, ``inspect``) show while a question is answered:
on stderr a spinner naming the method and the prompt's length ("full attention · 6,529 tokens"), a
progress bar when reading the prompt takes long, gone at the answer's first text; before it, while
``pages`` embeds a document's passages for the first time, how far that is ("embedding the pages ·
320/1,204 windows (27%)": on a terminal the spinner's label, in a pipe lines as for the prompt); on stdout the
answer as it is decoded (:class:`Reading`) — or, when it is printed whole at the end (a pipe,
``--json``), on stderr how far writing it has got; after it, one dim line of figures
(:func:`stats_line`)."""

from __future__ import annotations

import sys
import time
from collections import deque

from rich.console import Console

from ..answer.question import QuestionOptions
from .console import write_answer

BAR_AFTER_S = 1.0  # reading the prompt for longer than this: a bar instead of the spinner
LINE_AFTER_S = 5.0  # stderr not a terminal: progress lines once reading has taken this long ...
LINE_EVERY_S = 30.0  # ... one every tenth of the prompt, or this often
ETA_AFTER = 0.1  # the time left is said once this share of the prompt is read (the first chunks are cheaper)
RATE_WINDOW_S = 30.0  # ... from the rate over this last stretch of the read (the overall rate before)
RATE_MIN_SPAN_S = 5.0  # the stretch is used once it spans this long
EMBED_LABEL = "embedding the pages"  # what pages' retrieval does on a document's first question (on_embed)
TIP_EMBED_S = 5.0  # a question that embedded pages this long is told of `kvcli cache add` (embedding_tip)


def embedding_figures(done: int, total: int, elapsed: float) -> str:
    """ "320/1,204 windows (27%) · 41 windows/s · 0m 21s left" of a document's passages being
    embedded; the rate and the time left once a tenth is done (the model's first batches are slower)."""
    text = f"{done:,}/{total:,} windows ({100 * done / max(total, 1):.0f}%)"
    if elapsed > 0 and done >= ETA_AFTER * total and done < total:
        rate = done / elapsed
        left = (total - done) / rate
        text += f" · {rate:,.0f} windows/s · {int(left) // 60}m {int(left) % 60:02d}s left"
    return text


def reading_figures(
    fraction: float, n_tokens: int, elapsed: float, rate: float | None = None, start: float = 0.0
) -> str:
    """ "7,258/72,580 tokens (10%) · 402 tok/s · 2m 43s left" for a prompt read ``fraction`` of;
    ``rate``: tokens/s lately (default: over ``elapsed``, the seconds since ``start`` of the prompt
    was read: 0, or where a book read resumed). No time left before ``ETA_AFTER`` of the prompt is
    read (since ``start``): an early rate says little of the rest (and a prompt mostly stored, a
    warm book, reads few tokens)."""
    done = min(1.0, max(0.0, fraction)) * n_tokens
    if rate is None:
        rate = (done - start * n_tokens) / elapsed if elapsed > 0 else 0.0
    text = f"{done:,.0f}/{n_tokens:,} tokens ({100 * min(1.0, fraction):.0f}%)"
    if rate > 0 and fraction - start >= ETA_AFTER:
        left = (n_tokens - done) / rate
        text += f" · {rate:,.0f} tok/s · {int(left) // 60}m {int(left) % 60:02d}s left"
    return text


class RecentRate:
    """Tokens/s over the last ``RATE_WINDOW_S`` of a read (None until that stretch spans
    ``RATE_MIN_SPAN_S``): the time left follows the speed the read has now, not its first chunks'."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, float]] = deque()  # (time, tokens read)

    def add(self, now: float, done: float) -> float | None:
        self.samples.append((now, done))
        while len(self.samples) > 2 and self.samples[1][0] <= now - RATE_WINDOW_S:
            self.samples.popleft()  # keep one sample at or before the stretch's start
        then, before = self.samples[0]
        return (done - before) / (now - then) if now - then >= RATE_MIN_SPAN_S else None


class Reading:
    """``with Reading(err) as reading: session.ask(..., reading.options(stream))``.

    ``stream``: write the answer to stdout as it is decoded (a terminal, not --json). Everything
    on stderr is transient: nothing of it is left once the answer starts."""

    def __init__(self, err: Console, label: str = "reading the prompt…") -> None:
        self.err = err
        self.label = label
        self.status = None
        self.progress = None
        self.task = None
        self.t0 = time.perf_counter()
        self.wrote = False  # some of the answer is on stdout (a line to end on Ctrl-C)
        self.n_tokens = 0  # the prompt's (on_prompt)
        self.tenth, self.last_line = 0, 0.0  # progress lines said so far (stderr not a terminal)
        self.start = 0.0  # the prompt read before this run (a resumed book read: on_resume)
        self.waited = 0.0  # when the last "waiting for another kvcli process" line was said (piped)
        self.rate = RecentRate()
        self.n_answer, self.t_answer = 0, 0.0  # answer tokens written so far, since (on_token)
        self.embedding: tuple[float, int, float] | None = None  # (since, tenth said, last line): on_embed
        self.embedding_s = 0.0  # how long this question embedded pages, in all (on_embed)

    def __enter__(self) -> Reading:
        self.status = self.err.status(self.label, spinner="dots")
        self.status.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def options(self, stream: bool, sources: bool | None = None) -> QuestionOptions:
        """Session.ask's options with these callbacks; ``stream``: the answer on stdout as it is
        decoded, else how far writing it has got on stderr (:meth:`on_token`). ``sources``: whether
        to cite the answer's sources (None: the session's option)."""
        return QuestionOptions(
            sources=sources,
            on_prompt=self.on_prompt,
            on_progress=self.on_progress,
            on_text=self.write if stream else None,
            on_token=None if stream else self.on_token,
            on_wait=self.on_wait,
            on_resume=self.on_resume,
            on_embed=self.on_embed,
        )

    def on_embed(self, done: int, total: int) -> None:
        """While ``pages`` embeds the document's passages (its first question on that document):
        on a terminal the spinner says how far ("embedding the pages · 320/1,204 windows (27%) ·
        41 windows/s · 0m 21s left"), back to its label once done; elsewhere (a pipe, a log) one
        line every tenth or LINE_EVERY_S, once embedding has taken LINE_AFTER_S."""
        if self.err.quiet or self.wrote:
            return
        now = time.perf_counter()
        if self.embedding is None:
            self.embedding = (now, 0, now)
        since, tenth_said, last = self.embedding
        figures = embedding_figures(done, total, now - since)
        if done >= total:
            self.embedding = None
            self.embedding_s += now - since
            if self.status is not None:
                self.status.update(self.label)
            return
        if self.err.is_terminal:
            if self.status is not None:
                self.status.update(f"{EMBED_LABEL} · {figures}")
            return
        tenth = 10 * done // max(total, 1)
        if now - since >= LINE_AFTER_S and (tenth > tenth_said or now - last >= LINE_EVERY_S):
            self.embedding = (since, tenth, now)
            self.err.print(f"kvcli: {EMBED_LABEL}: {figures}", markup=False, highlight=False, soft_wrap=True)

    def on_wait(self, text: str | None) -> None:
        """While another kvcli process computes this document's KV: ``text`` (what it reads, how far)
        instead of the spinner's label, or piped one line at once and one every LINE_EVERY_S;
        None: the wait is over (the reading's figures count from now)."""
        now = time.perf_counter()
        if text is None:
            self.t0 = now
            if self.status is not None:
                self.status.update(self.label)
            return
        if self.err.quiet:
            return
        if self.err.is_terminal:
            if self.status is not None:
                self.status.update(text)
        elif not self.waited or now - self.waited >= LINE_EVERY_S:
            self.waited = now
            self.err.print(f"kvcli: {text}", markup=False, highlight=False, soft_wrap=True)

    def on_resume(self, fraction: float) -> None:
        """A book read resumes with ``fraction`` of the prompt read already (its rate counts the rest)."""
        self.start, self.tenth, self.t0 = fraction, int(fraction * 10), time.perf_counter()
        self.rate = RecentRate()
        self.rate.add(self.t0, fraction * self.n_tokens)

    def on_prompt(self, method: str, n_tokens: int) -> None:
        self.label = f"{method} · {n_tokens:,} tokens"
        self.n_tokens = n_tokens
        self.t0 = time.perf_counter()
        if self.status is not None:
            self.status.update(self.label)

    def on_progress(self, fraction: float) -> None:
        """While the prompt is read: on a terminal, after BAR_AFTER_S, a bar with the tokens read
        of the total, tokens/s and the time left; elsewhere (a pipe, a log) one line every tenth
        of the prompt or LINE_EVERY_S, once reading has taken LINE_AFTER_S."""
        if self.err.quiet or self.wrote:
            return
        now = time.perf_counter()
        elapsed = now - self.t0
        rate = self.rate.add(now, fraction * self.n_tokens)
        if not self.err.is_terminal:
            tenth = int(fraction * 10)
            if (
                fraction < 1
                and elapsed >= LINE_AFTER_S
                and (tenth > self.tenth or now - self.last_line >= LINE_EVERY_S)
            ):
                self.tenth, self.last_line = tenth, now
                figures = reading_figures(fraction, self.n_tokens, elapsed, rate, self.start)
                self.err.print(f"kvcli: {self.label}: {figures}", markup=False, highlight=False, soft_wrap=True)
            return
        if self.progress is None:
            if self.status is None:
                return
            if fraction - self.start >= 0.5 * (1 - self.start) or elapsed < BAR_AFTER_S:
                return  # short (or nearly done): the spinner is enough
            from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self.status.stop()
            self.status = None
            self.progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.fields[figures]}"),
                TimeElapsedColumn(),
                console=self.err,
                transient=True,
            )
            self.task = self.progress.add_task(self.label, total=1.0, figures="")
            self.progress.start()
        if now - self.last_line >= 0.25 or fraction >= 1:
            self.last_line = now
            figures = reading_figures(fraction, self.n_tokens, elapsed, rate, self.start)
            self.progress.update(self.task, completed=fraction, figures=figures)

    def on_token(self, token: int) -> None:
        """An answer token, the answer printed whole at the end (a pipe, --json): on a terminal
        the spinner says "writing the answer · 12 tokens"; elsewhere a line once writing has taken
        LINE_AFTER_S, then one every LINE_EVERY_S — never a silent minute."""
        if self.err.quiet:
            return
        now = time.perf_counter()
        self.n_answer += 1
        if self.n_answer == 1:
            self.t_answer = self.last_line = now
            if self.progress is not None:
                self.progress.stop()
                self.progress = None
            if self.err.is_terminal and self.status is None:
                self.status = self.err.status("writing the answer…", spinner="dots")
                self.status.start()
        figures = writing_figures(self.n_answer, now - self.t_answer)
        if self.err.is_terminal:
            if self.status is not None:
                self.status.update(f"writing the answer · {figures}")
        elif now - self.t_answer >= LINE_AFTER_S and (
            self.last_line == self.t_answer or now - self.last_line >= LINE_EVERY_S
        ):
            self.last_line = now
            self.err.print(f"kvcli: writing the answer: {figures}", markup=False, highlight=False, soft_wrap=True)

    def write_whole(self, text: str) -> None:
        """The answer whole on stdout once final (a pipe), before its check and sources: stderr's
        spinner stopped first, since a live display on a terminal takes sys.stdout over while it
        runs (what is written then would go to stderr)."""
        self.stop()
        write_answer(text)

    def write(self, piece: str) -> None:
        """A piece of the answer on stdout, at once (the first one clears stderr's line)."""
        if not self.wrote:
            self.stop()
            self.wrote = True
        sys.stdout.write(piece)
        sys.stdout.flush()


def writing_figures(n_answer: int, elapsed: float) -> str:
    """ "12 tokens · 0.4 tok/s" of an answer being written."""
    rate = f" · {(n_answer - 1) / elapsed:,.1f} tok/s" if n_answer > 1 and elapsed > 0 else ""
    return f"{n_answer:,} token{'' if n_answer == 1 else 's'}{rate}"


def answer(
    err: Console,
    session,
    document,
    question: str,
    pipeline,
    stream: bool,
    sources: bool | None = None,
    reading: Reading | None = None,
    whole: bool = False,
):
    """``session.ask`` with the spinner, the bar and (``stream``) the answer on stdout as it is
    decoded, or (``whole``) written whole once it is final, before the check after it and its
    sources; on Ctrl-C the answer's line is ended before the interrupt goes on up. ``sources``:
    whether to cite the answer's sources (None: the session's option); ``reading``: the
    :class:`Reading` to show it with (what it saw stays readable after), else a new one."""
    reading = reading or Reading(err)
    options = reading.options(stream, sources)
    if whole:
        options.on_answer = reading.write_whole
    try:
        with reading:
            return session.ask(document, question, pipeline, options)
    except KeyboardInterrupt:
        if reading.wrote:
            sys.stdout.write("\n")
            sys.stdout.flush()
        raise


def embedding_tip(seconds: float, source: str) -> str | None:
    """What a question that spent ``seconds`` embedding the pages of ``source`` is told after its
    answer, on a terminal: that ``kvcli cache add`` does it once, ahead (None: under
    :data:`TIP_EMBED_S`, or the document came on stdin)."""
    import shlex

    if seconds < TIP_EMBED_S or source == "-":
        return None
    return (
        f"kvcli: {seconds:.0f} s of this question went to embedding pages it points to; "
        f"`kvcli cache add {shlex.quote(source)}` embeds every page once, ahead of later questions"
    )


def stats_line(result, pipeline) -> str:
    """The dim line after an answer: the method (its name and the knobs the user set), the KV
    kept (and, for a stored book, the share the answer read), timings, memory, the disk cache."""
    cache = result.extra["cache"]
    saved = f" (saved {cache['saved_s']:.1f}s)" if cache["status"] == "hit" and cache["saved_s"] is not None else ""
    said = f"cache {cache['status']}{saved}"
    if cache["status"] == "off" and result.selection.retrieved:  # it retrieved (pages): no prefix
        said = "nothing cached: what it reads depends on the question"
    from ..answer.labels import spec_label  # the library, as the answer is (not for --help)

    method = spec_label(result.extra.get("compressor", pipeline.spec()), pipeline)
    return (
        f"{method} · {kv_figures(result)} · "
        f"TTFT {result.ttft_s:.2f}s · total {result.total_s:.2f}s · peak {result.peak_mem_mb:,.0f} MiB · {said}"
    )


def kv_figures(result) -> str:
    """ "KV kept 3,120/12,480 tokens (4.0×)": the prompt's KV held and the compression ratio. On a
    hybrid (Gemma 2 / 3) the sliding layers hold only their window under full attention too, so
    the ratio is against full attention, said so; a stored book adds the share the answer read. A
    method that retrieves (pages) says what it read instead ("read p. 12 whole, p. 3 skimmed: 760 of
    74,000 document tokens"): no ratio against a full attention that may not fit the window."""
    if result.selection.retrieved and result.document is not None:  # it retrieved: what it read
        from ..compressors.selection import read_line

        return read_line(result.selection.read, result.prompt, result.document)
    kept = f"KV kept {result.n_kept_tokens:,.0f}/{result.prompt.n_tokens:,} tokens"
    if result.windows is not None and result.windows.hybrid:
        kept += f" (sliding windows; {result.compression_ratio:.1f}× compression vs full attention)"
    else:
        kept += f" ({result.compression_ratio:.1f}×)"
    read = (result.extra.get("method_stats") or {}).get("kv_read_frac")
    return kept if read is None else f"{kept}, {read:.0%} of it read"
