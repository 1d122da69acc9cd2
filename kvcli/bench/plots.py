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
            cell = [float(r.get("score", r.get("correct", 0)) or 0) for r in rows if r["method"] == method and r["length"] == n and r["depth"] == d]
            line.append(statistics.mean(cell) if cell else None)
        grid.append(line)
    return grid


def _heatmap(ax, grid, lengths, depths, cmap, title: str):
    import numpy as np

    data = np.array([[np.nan if v is None else v for v in line] for line in grid], dtype=float)
    image = ax.imshow(data, cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(len(lengths)), [length_label(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xticks([x - 0.5 for x in range(1, len(lengths))], minor=True)
    ax.set_yticks([y - 0.5 for y in range(1, len(depths))], minor=True)
    ax.grid(which="minor", color="white", linewidth=2)
    ax.tick_params(which="minor", length=0)
    for y, line in enumerate(grid):
        for x, v in enumerate(line):
            text = "—" if v is None else f"{v:.2g}"
            ax.text(x, y, text, ha="center", va="center", fontsize=9, color="black")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title, fontsize=10)
    return image


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
        image = _heatmap(ax, grid, lengths, depths, cmap, f"{method}{suffix}\nneedle accuracy {mean:.0%}")
        fig.colorbar(image, ax=ax, fraction=0.05, pad=0.03)
        path = out_dir / f"needle_{method_slug(method)}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    if combined and len(methods) > 1:
        width = 0.9 + 0.75 * len(lengths)
        fig, axes = plt.subplots(
            1, len(methods), figsize=(width * len(methods) + 1.2, 1.9 + 0.45 * len(depths)), sharey=True, squeeze=False, layout="constrained"
        )
        image = None
        for ax, method in zip(axes[0], methods):
            image = _heatmap(ax, grids[method], lengths, depths, cmap, f"{method}\n{_overall(grids[method]):.0%}")
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
            points = sorted((r["n_context_tokens"], r[field]) for r in rows if r["method"] == method and r.get(field) is not None)
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
    fig.suptitle(f"Speed and memory vs context length{' · ' + _model_label(model) if model else ''}", fontsize=11)
    fig.tight_layout(rect=(0, 0.06 + 0.04 * ((len(labels) - 1) // 4 if labels else 0), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
