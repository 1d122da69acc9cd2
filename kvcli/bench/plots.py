"""The papers' figures from benchmark rows: needle heatmaps and speed curves (matplotlib, Agg).

matplotlib is imported inside the functions, so importing this module (and starting the CLI) costs
nothing. Every function takes the plain row dicts of :mod:`kvcli.bench.runner` / :mod:`.speed`
and writes PNG files; it returns their paths.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from .runner import length_label

# red -> yellow -> green, as in the needle-in-a-haystack figures (Kamradt's LLMTest colours)
NEEDLE_COLOURS = ("#F0496E", "#EBB839", "#0CD79F")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def method_slug(spec: str) -> str:
    """A file-name-safe form of a method spec: ``gemfilter:k=256`` -> ``gemfilter-k256``."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", spec.replace("=", "")).strip("-") or "method"


def accuracy_grid(rows: list[dict], method: str, lengths: list[int], depths: list[float]) -> list[list[float | None]]:
    """[depth][length] -> mean score of that method's rows (None: not run; errors score 0)."""
    grid = []
    for d in depths:
        line = []
        for n in lengths:
            cell = [
                float(r.get("score", r.get("correct", 0)) or 0)
                for r in rows
                if r["method"] == method and r["length"] == n and r["depth"] == d
            ]
            line.append(statistics.mean(cell) if cell else None)
        grid.append(line)
    return grid


def _heatmap(
    ax,
    grid,
    xlabels,
    ylabels,
    cmap,
    title: str,
    xlabel: str = "context length (tokens)",
    ylabel: str = "needle depth",
    fmt=lambda v: f"{v:.2g}",
):
    """``grid[y][x]`` in 0..1 (None: not run) as coloured cells with ``fmt(value)`` written in them."""
    import numpy as np

    data = np.array([[np.nan if v is None else v for v in line] for line in grid], dtype=float)
    image = ax.imshow(data, cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(len(xlabels)), xlabels)
    ax.set_yticks(range(len(ylabels)), ylabels)
    ax.set_xticks([x - 0.5 for x in range(1, len(xlabels))], minor=True)
    ax.set_yticks([y - 0.5 for y in range(1, len(ylabels))], minor=True)
    ax.grid(which="minor", color="white", linewidth=2)
    ax.tick_params(which="minor", length=0)
    for y, line in enumerate(grid):
        for x, v in enumerate(line):
            text = "—" if v is None else fmt(v)
            ax.text(x, y, text, ha="center", va="center", fontsize=9, color="black")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    return image


def _needle_labels(lengths, depths) -> tuple[list[str], list[str]]:
    return [length_label(n) for n in lengths], [f"{d:.0%}" for d in depths]


def needle_heatmaps(rows: list[dict], out_dir: Path, model: str = "", combined: bool = True) -> list[Path]:
    """One heatmap PNG per method (``needle_<method>.png``: x context length, y needle depth, colour
    the share of correct answers, value written in each cell) and, with several methods,
    ``needle.png`` with all of them side by side."""
    plt = _pyplot()
    from matplotlib.colors import LinearSegmentedColormap

    cmap = LinearSegmentedColormap.from_list("needle", NEEDLE_COLOURS).with_extremes(bad="#DDDDDD")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lengths = sorted(dict.fromkeys(r["length"] for r in rows))
    depths = sorted(dict.fromkeys(r["depth"] for r in rows))
    suffix = f" · {_model_label(model)}" if model else ""
    paths = []
    grids = {}
    for method in methods:
        grid = grids[method] = accuracy_grid(rows, method, lengths, depths)
        fig, ax = plt.subplots(figsize=(2.2 + 0.9 * len(lengths), 1.6 + 0.45 * len(depths)), layout="constrained")
        mean = _overall(grid)
        image = _heatmap(
            ax, grid, *_needle_labels(lengths, depths), cmap, f"{method}{suffix}\nneedle accuracy {mean:.0%}"
        )
        fig.colorbar(image, ax=ax, fraction=0.05, pad=0.03)
        path = out_dir / f"needle_{method_slug(method)}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    if combined and len(methods) > 1:
        width = 0.9 + 0.75 * len(lengths)
        fig, axes = plt.subplots(
            1,
            len(methods),
            figsize=(width * len(methods) + 1.2, 1.9 + 0.45 * len(depths)),
            sharey=True,
            squeeze=False,
            layout="constrained",
        )
        image = None
        for ax, method in zip(axes[0], methods):
            image = _heatmap(
                ax, grids[method], *_needle_labels(lengths, depths), cmap, f"{method}\n{_overall(grids[method]):.0%}"
            )
            if ax is not axes[0][0]:
                ax.set_ylabel("")
        fig.suptitle(f"Needle in a haystack{suffix}", fontsize=11)
        fig.colorbar(image, ax=list(axes[0]), fraction=0.02, pad=0.01)
        path = out_dir / "needle.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def _model_label(model: str) -> str:
    """A model path as its folder name; hub ids and the embedded name as they are."""
    return Path(model).name if "/" in model and Path(model).expanduser().exists() else model


def _overall(grid) -> float:
    values = [v for line in grid for v in line if v is not None]
    return statistics.mean(values) if values else 0.0


SPEED_PANELS = (
    ("ttft_s", "TTFT (s)"),
    ("decode_tokens_per_s", "decode (tokens/s)"),
    ("peak_mem_mb", "peak memory (MiB)"),
)


def speed_plot(rows: list[dict], path: Path, model: str = "") -> Path:
    """``speed.png``: TTFT, decode tokens/s and peak memory vs context length, one line per method."""
    plt = _pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [r for r in rows if not r.get("error")]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, len(SPEED_PANELS), figsize=(4.2 * len(SPEED_PANELS), 3.6))
    markers = "osD^vP*Xh<>"
    for ax, (field, label) in zip(axes, SPEED_PANELS):
        for i, method in enumerate(methods):
            points = sorted(
                (r["n_context_tokens"], r[field]) for r in rows if r["method"] == method and r.get(field) is not None
            )
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker=markers[i % len(markers)], label=method)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=9, frameon=False)
    return _save(fig, path, "Speed and memory vs context length", model, labels, (0.06, 0.04))


def _save(fig, path: Path, title: str, model: str, labels: list, legend_room: tuple[float, float]) -> Path:
    """Title (with the model), room at the bottom for a legend of ``labels`` (4 per row), PNG."""
    import matplotlib.pyplot as plt

    fig.suptitle(f"{title}{' · ' + _model_label(model) if model else ''}", fontsize=11)
    base, per_row = legend_room
    fig.tight_layout(rect=(0, base + per_row * ((len(labels) - 1) // 4 if labels else 0), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def ruler_plot(rows: list[dict], path: Path, model: str = "") -> Path:
    """``ruler.png``, kvpress-leaderboard style: x the compression ratio (1 = full attention, log
    scale), y RULER's average score, one line per method over its ratios, full attention as a
    dashed ceiling, one panel per length. Methods run at their own settings are single points at
    their measured ratio."""
    from .ruler import average_scores, measured_ratios, method_runs

    plt = _pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lengths = sorted(dict.fromkeys(r["length"] for r in rows))
    runs = method_runs(rows)
    averages = average_scores(rows)
    ratios = sorted({r for _, r in runs if r is not None})
    fig, axes = plt.subplots(1, len(lengths), figsize=(max(7.0, 4.4 * len(lengths)), 4.2), sharey=True, squeeze=False)
    markers = "osD^vP*Xh<>"
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    methods = [m for m in dict.fromkeys(m for m, _ in runs) if m != "full"]
    top = max([v for v in averages.values()] + [1.0])
    xs_all = [1.0, *ratios]
    for ax, n in zip(axes[0], lengths):
        measured = measured_ratios([r for r in rows if r["length"] == n])
        if (n, "full", None) in averages:
            y = averages[(n, "full", None)]
            ax.axhline(y, color="black", linestyle="--", linewidth=1.2, label="full attention")
            ax.plot([1.0], [y], marker="o", color="black")
        for i, method in enumerate(methods):
            style = dict(color=colours[i % len(colours)], marker=markers[i % len(markers)])
            points = sorted(
                (r, averages[(n, m, r)]) for m, r in runs if m == method and r is not None and (n, m, r) in averages
            )
            if points:
                ax.plot(*zip(*points), label=method, **style)
            if (n, method, None) in averages:  # its own settings: at the ratio it measured
                x = measured.get((method, None)) or 1.0
                xs_all.append(x)
                ax.plot([x], [averages[(n, method, None)]], linestyle="none", markersize=8, markerfacecolor="none",
                        label=f"{method} (own settings)", **style)  # fmt: skip
        ax.set_xscale("log", base=2)
        ticks = sorted(set([1.0, *ratios]))
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.set_xlim(min(xs_all) / 1.25, max(xs_all) * 1.25)
        ax.set_ylim(0, min(100, max(10, top * 1.15)))
        ax.set_xlabel("compression ratio (1 = full attention)")
        ax.set_title(f"{length_label(n)} tokens", fontsize=10)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("RULER average score")
    handles, labels = {}, []
    for ax in axes[0]:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    labels = list(handles)
    if labels:
        fig.legend(
            [handles[k] for k in labels],
            labels,
            loc="lower center",
            ncol=min(len(labels), 4),
            fontsize=9,
            frameon=False,
        )
    return _save(fig, path, "RULER vs compression ratio", model, labels, (0.07, 0.05))


def ruler_task_heatmap(rows: list[dict], path: Path, model: str = "") -> Path:
    """``ruler_tasks.png``: per length a panel of task × (method, ratio), colour and number the
    task's mean score (0-100)."""
    from matplotlib.colors import LinearSegmentedColormap

    from .ruler import TASK_NAMES, method_runs, run_label, task_scores

    plt = _pyplot()
    cmap = LinearSegmentedColormap.from_list("ruler", NEEDLE_COLOURS).with_extremes(bad="#DDDDDD")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lengths = sorted(dict.fromkeys(r["length"] for r in rows))
    tasks = [t for t in TASK_NAMES if any(r["task"] == t for r in rows)]
    runs = method_runs(rows)
    scores = task_scores(rows)
    width = 1.6 + 0.62 * len(runs)
    fig, axes = plt.subplots(
        1,
        len(lengths),
        figsize=(width * len(lengths) + 1.0, 1.6 + 0.36 * len(tasks)),
        sharey=True,
        squeeze=False,
        layout="constrained",
    )
    image = None
    for ax, n in zip(axes[0], lengths):
        grid = [
            [None if (n, m, r, t) not in scores else scores[(n, m, r, t)].mean / 100 for m, r in runs] for t in tasks
        ]
        image = _heatmap(
            ax,
            grid,
            [run_label(m, r) for m, r in runs],
            tasks,
            cmap,
            f"{length_label(n)} tokens",
            "method",
            "task" if ax is axes[0][0] else "",
            fmt=lambda v: f"{100 * v:.0f}",
        )
        ax.tick_params(axis="x", labelrotation=45)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    fig.suptitle(f"RULER score per task{' · ' + _model_label(model) if model else ''}", fontsize=11)
    fig.colorbar(image, ax=list(axes[0]), fraction=0.02, pad=0.01).set_label("score / 100")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def memory_plot(rows: list[dict], path: Path, model: str = "") -> Path:
    """``memory.png``: the simulated accelerator's peak memory (GiB, weights included) vs sequence
    length, one line per method (the same colour and marker in every panel), one panel per
    (config, weights, offload), three panels a row; failed rows are left out."""
    plt = _pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [r for r in rows if not r.get("error") and r.get("peak_bytes") is not None]
    panel = lambda r: (r["config"], r["weights"], r.get("kv_offload", "none"), r.get("kv_bits", 16))  # noqa: E731
    panels = list(dict.fromkeys(panel(r) for r in rows)) or [("", "", "none", 16)]
    ncols = min(3, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.4 * ncols, 3.8 * nrows + 0.6), squeeze=False)
    markers = "osD^vP*Xh<>"
    colours = plt.get_cmap("tab20").colors
    methods = list(dict.fromkeys(r["method"] for r in rows))
    style = {m: dict(marker=markers[i % len(markers)], color=colours[i % len(colours)]) for i, m in enumerate(methods)}
    flat = [ax for line in axes for ax in line]
    for ax in flat[len(panels) :]:
        ax.axis("off")
    for ax, (config, weights, offload, bits) in zip(flat, panels):
        mine = [r for r in rows if panel(r) == (config, weights, offload, bits)]
        for method in methods:
            points = sorted((r["tokens"], r["peak_bytes"] / 2**30) for r in mine if r["method"] == method)
            if points:
                ax.plot(*zip(*points), label=method, **style[method])
        if mine:
            ax.axhline(mine[0]["weights_bytes"] / 2**30, color="grey", linestyle=":", linewidth=1, label="weights")
        ticks = sorted({r["tokens"] for r in mine})
        ax.set_xticks(ticks, [length_label(t) for t in ticks], rotation=45)
        ax.set_xlabel("tokens (prompt + generated)")
        ax.set_ylabel("simulated peak (GiB)")
        title = f"{config} · {weights}" + (" · offload cpu" if offload != "none" else "")
        ax.set_title(title + ("" if bits == 16 else f" · {bits}-bit KV"), fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    labels: dict = {}
    for ax in flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            labels.setdefault(label, h)
    if labels:
        fig.legend(
            list(labels.values()), list(labels), loc="lower center", ncol=min(len(labels), 4), fontsize=9, frameon=False
        )
    return _save(fig, path, "Simulated accelerator memory vs length", model, list(labels), (0.06 / nrows, 0.04 / nrows))
