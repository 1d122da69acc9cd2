"""What the answering commands (``ask``, ``chat``) show while a question is answered: on stderr a
spinner naming the method and the prompt's length ("full attention · 6,529 tokens"), a progress
bar when reading the prompt takes long, gone at the answer's first text; on stdout the answer as it
is decoded (:class:`Reading`); after it, one dim line of figures (:func:`stats_line`)."""

from __future__ import annotations

import sys
import time

from rich.console import Console

BAR_AFTER_S = 1.0  # reading the prompt for longer than this: a bar instead of the spinner
LINE_AFTER_S = 5.0  # stderr not a terminal: progress lines once reading has taken this long ...
LINE_EVERY_S = 30.0  # ... one every tenth of the prompt, or this often


def reading_figures(fraction: float, n_tokens: int, elapsed: float, start: float = 0.0) -> str:
    """"7,258/72,580 tokens (10%) · 402 tok/s · 2m 43s left" for a prompt read ``fraction`` of,
    ``start`` of it read before (a resumed book read) and the rest in ``elapsed`` seconds."""
    done = min(1.0, max(0.0, fraction)) * n_tokens
    rate = (done - start * n_tokens) / elapsed if elapsed > 0 else 0.0
    text = f"{done:,.0f}/{n_tokens:,} tokens ({100 * min(1.0, fraction):.0f}%)"
    if rate > 0 and fraction - start >= 0.01:  # a prompt mostly stored (a warm book) reads few tokens: no ETA from them
        left = (n_tokens - done) / rate
        text += f" · {rate:,.0f} tok/s · {int(left) // 60}m {int(left) % 60:02d}s left"
    return text


class Reading:
    """``with Reading(err) as reading: session.ask(..., **reading.callbacks(stream))``.

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

    def __enter__(self) -> "Reading":
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

    def callbacks(self, stream: bool) -> dict:
        return {"on_prompt": self.on_prompt, "on_progress": self.on_progress, "on_text": self.write if stream else None,
                "on_wait": self.on_wait, "on_resume": self.on_resume}

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
        if not self.err.is_terminal:
            tenth = int(fraction * 10)
            if fraction < 1 and elapsed >= LINE_AFTER_S and (tenth > self.tenth or now - self.last_line >= LINE_EVERY_S):
                self.tenth, self.last_line = tenth, now
                figures = reading_figures(fraction, self.n_tokens, elapsed, self.start)
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
                SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[figures]}"),
                TimeElapsedColumn(), console=self.err, transient=True,
            )
            self.task = self.progress.add_task(self.label, total=1.0, figures="")
            self.progress.start()
        if now - self.last_line >= 0.25 or fraction >= 1:
            self.last_line = now
            figures = reading_figures(fraction, self.n_tokens, elapsed, self.start)
            self.progress.update(self.task, completed=fraction, figures=figures)

    def write(self, piece: str) -> None:
        """A piece of the answer on stdout, at once (the first one clears stderr's line)."""
        if not self.wrote:
            self.stop()
            self.wrote = True
        sys.stdout.write(piece)
        sys.stdout.flush()


def answer(err: Console, session, document, question: str, pipeline, stream: bool):
    """``session.ask`` with the spinner, the bar and (``stream``) the answer on stdout as it is
    decoded; on Ctrl-C the answer's line is ended before the interrupt goes on up."""
    reading = Reading(err)
    try:
        with reading:
            return session.ask(document, question, pipeline, **reading.callbacks(stream))
    except KeyboardInterrupt:
        if reading.wrote:
            sys.stdout.write("\n")
            sys.stdout.flush()
        raise


def stats_line(result, pipeline) -> str:
    """The dim line after an answer: the method, the KV kept, timings, memory, the disk cache."""
    cache = result.extra["cache"]
    saved = f" (saved {cache['saved_s']:.1f}s)" if cache["status"] == "hit" and cache["saved_s"] is not None else ""
    return (
        f"{result.extra.get('compressor', pipeline.spec())} · KV kept {result.n_kept_tokens:,.0f}/{result.prompt.n_tokens:,} tokens ({result.compression_ratio:.1f}×) · "
        f"TTFT {result.ttft_s:.2f}s · total {result.total_s:.2f}s · peak {result.peak_mem_mb:,.0f} MiB · "
        f"cache {cache['status']}{saved}"
    )
