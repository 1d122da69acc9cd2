"""``kvcli bench memory``: peak accelerator memory, host syncs and host->device copies of each method,
simulated on the meta device (:mod:`kvcli.bench.simulate`). A command of ``kvcli bench``
(:mod:`kvcli.cli.bench` owns the group, the options and the grid runner its commands share)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from .. import kv_bits as kv_quant
from ..bench import runner
from ..bench.runner import ResultsFile, length_label
from ..errors import UsageError
from .bench import OutOpt, PlotOnlyOpt, ResumeOpt, bench_app, progress_bar
from .console import route_warnings, stderr, stdout
from .options import Offload, QuietOpt

MEMORY_METHODS, MEMORY_LENGTHS = "full;gemfilter;snapkv;finch;blocksparse", "32768,131072"

MEMORY_HELP = """Peak accelerator memory, host syncs and host->device copies of each method, simulated.

\b
    kvcli bench memory --simulate --config llama-3.1-8b --weights nf4 --lengths 32768,131072 --out bench/

--simulate runs kvcli's own pipeline, engine, caches and methods on a real model config
(llama-3.1-8b, qwen2.5-7b, mistral-nemo-12b, phi-3.5-mini; comma-separated for several) built on
PyTorch's meta device: shapes and storage sizes without data, an 8B model at 128k tokens in
seconds on a CPU. A dispatch-mode tracker counts live bytes (as the CUDA allocator books them),
host syncs and host->device copies; SDPA runs the kernel CUDA would pick. Data-dependent reads
are answered with a fixed value (token id 0); a method that cannot run there gets its row with
the error and the line of kvcli that raised. Tokens = prompt + --steps generated. --methods all:
every registered method at its defaults. Writes OUT/memory.json (after every cell),
OUT/memory_table.md, OUT/memory.png and, with Llama-3.1-8B nf4 rows, OUT/targets.md (the GPU
memory targets of docs/gpu-sim.md, met or missed); prints the table. See docs/gpu-sim.md.
"""


@bench_app.command("memory", help=MEMORY_HELP)
def memory(
    simulate: bool = typer.Option(
        False,
        "--simulate",
        help="Simulate the accelerator on the meta device (required: real-GPU peaks are in kvcli bench speed)",
    ),
    config: str = typer.Option(
        "llama-3.1-8b",
        "--config",
        help="Model config(s), comma-separated: llama-3.1-8b, qwen2.5-7b, mistral-nemo-12b, phi-3.5-mini",
    ),
    weights: str = typer.Option(
        "nf4", "--weights", help="Weights, comma-separated: nf4 (bitsandbytes 4-bit) and/or bf16"
    ),
    methods: str | None = typer.Option(
        None, "--methods", help=f"';'-separated method specs, or 'all' (default: {MEMORY_METHODS})", show_default=False
    ),
    lengths: str | None = typer.Option(
        None,
        help=f"Sequence lengths in tokens (prompt + generated), comma-separated (default: {MEMORY_LENGTHS})",
        show_default=False,
    ),
    steps: int = typer.Option(8, "--steps", min=2, help="Tokens generated per cell (decode steps measured: steps - 1)"),
    kv_offload: Offload = typer.Option(
        Offload.none, "--kv-offload", help="As kvcli ask --kv-offload (blocksparse keeps its KV in CPU memory)"
    ),
    kv_bits: str = typer.Option(
        kv_quant.AUTO,
        "--kv-bits",
        help="KV bits, comma-separated: 16, 8, 4 and/or auto (as kvcli ask --kv-bits: auto is 8 for a method "
        "whose KV layout is quantized, else 16); a row is labelled with the bits its method held",
    ),
    out: Path = OutOpt,
    resume: bool = ResumeOpt,
    plot_only: bool = PlotOnlyOpt,
    quiet: bool = QuietOpt,
) -> None:
    from ..bench.plots import memory_plot
    from ..bench.simulate import report
    from ..bench.simulate.models import CONFIGS, WEIGHTS
    from ..bench.simulate.run import MEMORY_KEY, open_model
    from ..bench.simulate.run import simulate as simulate_cell

    err = stderr(quiet)
    route_warnings(quiet)
    path = out / "memory.json"
    if plot_only:  # every row, failed ones too: a method that cannot run there is a result
        ResultsFile.read(path, MEMORY_KEY)  # a missing or unreadable file: one line
        _memory_report(json.loads(path.read_text()).get("rows", []), out, memory_plot, report)
        return
    if not simulate:
        raise UsageError("kvcli bench memory needs --simulate (peak memory on a real device: kvcli bench speed)")
    configs = [c.strip().lower() for c in config.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        raise UsageError(f"--config: unknown model '{','.join(unknown) or config}'; choose from {', '.join(CONFIGS)}")
    weight_kinds = [w.strip().lower() for w in weights.split(",") if w.strip()]
    if not weight_kinds or any(w not in WEIGHTS for w in weight_kinds):
        raise UsageError(f"--weights: comma-separated {' and/or '.join(WEIGHTS)}, not '{weights}'")
    from .. import method_catalog as catalog

    specs = (
        sorted(catalog.methods())
        if (methods or "").strip().lower() == "all"
        else runner.split_methods(methods or MEMORY_METHODS)
    )
    grid = runner.parse_lengths(lengths or MEMORY_LENGTHS)
    try:  # settings: each cell is labelled with the bits its method holds (auto: 8 or 16 by method)
        bits_grid = [kv_quant.check_bits(b.strip()) for b in kv_bits.split(",") if b.strip()] or [kv_quant.AUTO]
    except ValueError as e:
        raise UsageError(f"--kv-bits: {e}") from None
    results = ResultsFile(path, MEMORY_KEY, resume=resume)
    results.meta = {
        "simulated": "meta device, kvcli.bench.simulate",
        "steps": steps,
        "fixed_token": 0,
        "sdpa": "CUDA selection (flash > efficient > math), efficient without GQA",
    }
    cells = report.memory_cells(configs, weight_kinds, specs, grid, kv_offload.value, bits_grid)
    if resume and path.exists():  # failed rows of other grids stay in the file (ResultsFile drops them to re-run)
        ours = {runner.cell_key(c, MEMORY_KEY) for c in cells}
        results.rows += [
            r
            for r in json.loads(path.read_text()).get("rows", [])
            if r.get("error") and runner.cell_key(r, MEMORY_KEY) not in ours
        ]
    done = results.done()
    pending = [c for c in cells if runner.cell_key(c, MEMORY_KEY) not in done]
    failed = 0
    with progress_bar(err) as progress:
        task = progress.add_task("simulating", total=len(pending))
        sim = None
        for cell in pending:
            bits = report.bits_of(cell)
            label = f"{cell['config']} {cell['weights']} {length_label(cell['tokens'])} · {cell['method']}"
            label += "" if bits == 16 else f" · {bits}-bit KV"
            progress.update(task, description=label)
            if sim is None or (sim.config, sim.weights, sim.session.options.kv_bits) != (
                cell["config"],
                cell["weights"],
                bits,
            ):
                sim = open_model(cell["config"], cell["weights"], kv_offload.value, kv_bits=bits)
            row = simulate_cell(sim, cell["method"], cell["tokens"], steps)
            results.add(row)
            if row["error"]:
                failed += 1
                progress.console.print(f"[yellow]{label}: {row['error']}[/yellow]")
            elif not err.quiet:
                progress.console.print(
                    f"[dim]{label}  peak {row['peak_bytes'] / 2**30:.2f} GiB  KV {(row['kv_bytes'] or 0) / 2**30:.2f} GiB  "
                    f"syncs/step {row['syncs_per_decode_step']}  h2d/step {row['h2d_copies_per_decode_step']}[/dim]"
                )
            progress.advance(task)
    rows = runner.select_rows(
        results.rows, config=configs, weights=weight_kinds, method=specs, tokens=grid, kv_offload=[kv_offload.value]
    )
    paths = _memory_report(rows, out, memory_plot, report, every_row=results.rows)
    for p in [path, *paths]:
        err.print(f"[dim]wrote {p}[/dim]")
    if failed:
        err.print(
            f"[yellow]kvcli: {failed} of {len(pending)} cells could not run on the simulated device (their rows say why)[/yellow]"
        )


def _memory_report(rows, out: Path, draw, report, every_row=None) -> list[Path]:
    """The table and plot of ``rows`` (this grid), and the memory targets (simulated Llama-3.1-8B, nf4) over ``every_row`` in the
    file (default: ``rows``), so a run of one grid does not report the others' targets as not run."""
    if not rows:
        raise UsageError(f"no memory results to show in {out / 'memory.json'}")
    from ..files import atomic_write

    table = report.memory_table(rows)
    stdout.out(table)
    md = out / "memory_table.md"
    atomic_write(md, lambda tmp: Path(tmp).write_text(table + "\n", encoding="utf-8"))
    paths = [md, draw(rows, out / "memory.png")]
    every_row = rows if every_row is None else every_row
    # the memory targets (simulated Llama-3.1-8B, nf4)
    if any(r["config"] == "llama-3.1-8b" and r["weights"] == "nf4" for r in every_row):
        checks = report.targets_table(report.targets(every_row))
        paths.append(out / "targets.md")
        atomic_write(paths[-1], lambda tmp: Path(tmp).write_text(checks + "\n", encoding="utf-8"))
    return paths
