"""One grid runner for every benchmark: cells in, JSON-ready rows out, resumable.

A benchmark is a list of *cells* (plain dicts: ``{"length": 4096, "depth": 0.5, "method": "full"}``)
and a function that measures one cell and returns its row (a dict that repeats the cell's keys).
:func:`run_cells` runs the cells in order, skips those already in a :class:`ResultsFile` (resume),
saves the file after every row (an interrupted run keeps what finished) and reports progress
through callbacks. The needle grid (:func:`needle_cells`, :func:`needle_row`) and the speed grid
(:mod:`kvcli.bench.speed`) both run on it.

Every method sees the same documents in the same process, so TTFT ratios and peak memory are
comparable within a run.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from ..answer.question import QuestionOptions
from ..documents import document_from_text
from ..errors import KvcliError, UsageError
from .needle import make_case

if TYPE_CHECKING:
    from ..answer.pipeline import Pipeline

PROMPT_OVERHEAD = 64  # template + question tokens, roughly: documents get length - this
# method counters (``Result.extra["method_stats"]``) shown as table columns when a method reports them
STAT_COLUMNS = {"prompt_tokens_computed_frac": "computed", "kv_attended_frac": "KV attended"}


# --------------------------------------------------------------------------- specs, options


def pipeline(spec: str) -> Pipeline:
    """``spec`` as a :class:`~kvcli.answer.pipeline.Pipeline` (imported here, not at the top: the
    bench's tables and checks, and ``kvcli --help``, import no PyTorch)."""
    from ..answer.pipeline import Pipeline

    return Pipeline.parse(spec)


def split_methods(methods: str | Iterable[str]) -> list[str]:
    """``"full;gemfilter:k=256;snapkv:budget=256"`` -> specs (``;`` separates: specs contain commas)."""
    parts = methods.split(";") if isinstance(methods, str) else list(methods)
    specs = list(dict.fromkeys(p.strip() for p in parts if p.strip()))
    if not specs:
        raise UsageError('--methods: name at least one method, e.g. "full;gemfilter:k=256"')
    for spec in specs:
        pipeline(spec)  # unknown methods or knobs: a one-line UsageError, before any model loads
    return specs


def parse_lengths(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--lengths: comma-separated token counts, e.g. 1024,2048,4096, not '{text}'") from None
    if not values or any(v < PROMPT_OVERHEAD + 32 for v in values):
        raise UsageError(f"--lengths: every length must be at least {PROMPT_OVERHEAD + 32} tokens, got '{text}'")
    return list(dict.fromkeys(values))


def parse_depths(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--depths: comma-separated fractions in 0..1, e.g. 0,0.5,1, not '{text}'") from None
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise UsageError(f"--depths: every depth must be in 0..1 (0 = start, 1 = end), got '{text}'")
    return list(dict.fromkeys(values))


def check_lengths(lengths: Iterable[int], max_context: int | None, new_tokens: int, model_name: str) -> None:
    """Refuse lengths the model's window cannot hold (prompt + answer), as one line."""
    if not max_context:
        return
    too_long = [n for n in lengths if n + new_tokens > max_context]
    if too_long:
        raise UsageError(
            f"--lengths {','.join(map(str, too_long))}:{f' plus {new_tokens} new tokens,' if new_tokens else ''} over the "
            f"{max_context:,}-token window of {model_name}; use lengths up to {max_context - new_tokens:,}"
        )


def peek_max_context(model: str | None) -> int | None:
    """The window of a local model folder from its config.json, without loading it (else None)."""
    if not model:
        return None
    config = Path(model).expanduser() / "config.json"
    try:
        cfg = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg
    value = cfg.get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None


# --------------------------------------------------------------------------- results file


def cell_key(row: dict, fields: Iterable[str]) -> tuple:
    return tuple(row.get(f) for f in fields)


class ResultsFile:
    """``{"meta": {...}, "rows": [...]}`` on disk, rewritten atomically after every row."""

    def __init__(self, path: Path, key_fields: tuple[str, ...], resume: bool = False) -> None:
        self.path = Path(path)
        self.key_fields = key_fields
        self.meta: dict = {}
        self.rows: list[dict] = []
        if resume and self.path.exists():
            try:
                data = json.loads(self.path.read_text())
                self.meta, self.rows = data.get("meta", {}), list(data.get("rows", []))
            except (OSError, ValueError, AttributeError) as e:
                raise KvcliError(f"--resume: cannot read {self.path}: {e}") from None
        # failed cells are run again
        self.rows = [r for r in self.rows if not r.get("error")]

    @classmethod
    def read(cls, path: Path, key_fields: tuple[str, ...]) -> ResultsFile:
        if not Path(path).exists():
            raise UsageError(f"no results at {path}; run the benchmark first")
        return cls(path, key_fields, resume=True)

    def begin_run(self, meta: dict) -> None:
        """This command's settings (:func:`run_meta`) as ``meta``, and, after the settings of the
        commands before it (a ``--resume``), in ``meta["runs"]`` (oldest first); each row this
        command adds notes its index there (``row["run"]``), so a file grown over several
        commands (other threads, dates, options) says which made each row."""
        runs = list(self.meta.get("runs", []))
        if self.meta and not runs:  # a file written before runs were kept: its one command's
            runs = [{k: v for k, v in self.meta.items() if k != "runs"}]
        runs.append(dict(meta))
        self.meta = {**meta, "runs": runs}
        self.run_index = len(runs) - 1

    run_index: int | None = None

    def done(self) -> set[tuple]:
        return {cell_key(r, self.key_fields) for r in self.rows}

    def add(self, row: dict, extra: dict | None = None) -> None:
        key = cell_key(row, self.key_fields)
        if self.run_index is not None:
            row = {**row, "run": self.run_index}
        self.rows = [r for r in self.rows if cell_key(r, self.key_fields) != key] + [row]
        self.save(extra)

    def save(self, extra: dict | None = None) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"meta": self.meta, "rows": self.rows, **(extra or {})}
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False))
        os.replace(tmp, self.path)  # never a half-written file, even when interrupted


def run_meta(session, **extra) -> dict:
    import torch

    from ..model.names import spelled

    lm = session.lm
    return {
        "model": lm.name,
        "device": str(session.engine.device),
        "dtype": str(lm.dtype).replace("torch.", ""),
        "attn": lm.attn,
        "quant": spelled(lm.quant),
        "int8_kernel": lm.int8_kernel,
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "lookup": session.options.lookup,  # tokens drafted a pass (kvcli.runtime.lookup): decoding's pace
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        **extra,
    }


# --------------------------------------------------------------------------- the grid runner


def run_cells(
    cells: list[dict],
    measure_cell: Callable[[dict], dict],
    results: ResultsFile | None = None,
    *,
    model: str | None = None,
    on_start: Callable[[dict], None] | None = None,
    on_row: Callable[[dict], None] | None = None,
    keep_going: bool = True,
) -> list[dict]:
    """Measure every cell not already in ``results`` (cells get ``model`` added); returns the new rows.

    A cell whose method fails with a user error (:class:`KvcliError`, e.g. a budget larger than the
    prompt) gives a row with ``"error"`` and the grid goes on (unless ``keep_going`` is False);
    ``--resume`` runs it again.
    """
    done = results.done() if results is not None else set()
    new = []
    for cell in cells:
        cell = {"model": model, **cell} if model is not None else dict(cell)
        if results is not None and cell_key(cell, results.key_fields) in done:
            continue
        if on_start is not None:
            on_start(cell)
        try:
            row = {**cell, **measure_cell(cell)}
        except KvcliError as e:
            if not keep_going:
                raise
            row = {**cell, "error": str(e)}
        new.append(row)
        if results is not None:
            results.add(row)
        if on_row is not None:
            on_row(row)
    return new


def ask(session, document, question: str, pipeline: Pipeline, max_new_tokens: int, force_tokens: bool = False):
    """A cold :meth:`kvcli.api.Session.ask` (no disk store); ``force_tokens``: ignore the stop
    tokens and generate exactly ``max_new_tokens`` (so decode tokens/s measures that many steps). The
    answer is never checked against the document (``kvcli ask --check``): a benchmark scores it."""
    options = QuestionOptions(max_new_tokens=max_new_tokens, force_tokens=force_tokens, use_store=False, check=False)
    return session.ask(document, question, pipeline, options)


def warm_up(session, specs: Iterable[str] = ("full",)) -> None:
    """A short answer with each method, so the first measured cells pay no one-time costs
    (a method that cannot run on a short document is skipped)."""
    case = make_case(session.lm.tokenizer, 320, 0.5, seed=0, haystack="filler")
    document = document_from_text(case.text, source="warm-up")
    for spec in dict.fromkeys(["full", *specs]):
        try:
            ask(session, document, case.question, pipeline(spec), 2)
        except KvcliError:
            pass


def result_fields(result) -> dict:
    """The measured fields every benchmark row has, from a :class:`kvcli.answer.pipeline.Result`."""
    return {
        "n_context_tokens": result.prompt.n_tokens,
        "n_kept_tokens": result.n_kept_tokens,
        "compression_ratio": result.compression_ratio,
        "ttft_s": result.ttft_s,
        "total_s": result.total_s,
        "decode_tokens_per_s": result.decode_tokens_per_s,
        "n_answer_tokens": len(result.answer_ids),
        "peak_mem_mb": result.peak_mem_mb,
        "kv_cache_mb": result.extra.get("kv_cache_bytes", 0) / 2**20,
        "method_stats": result.extra.get("method_stats", {}) or {},
        "lookup": result.extra.get("lookup"),  # drafts: passes, drafted, taken (None: a pass a token)
    }


# --------------------------------------------------------------------------- the needle grid

NEEDLE_KEY = ("model", "haystack", "method", "length", "depth", "sample")


def case_seed(seed: int, length: int, depth: float, sample: int) -> int:
    """The passkey's seed: depends on the cell's values, not its place in the grid (resume-safe)."""
    return seed * 1_000_003 + sample * 10_007 + length * 7 + int(round(depth * 1000))


def needle_cells(specs, lengths, depths, samples: int = 1, haystack: str = "essays") -> list[dict]:
    """Length-major, then depth, then sample, then method: every method reads a document right
    after it is built."""
    return [
        {"haystack": haystack, "method": spec, "length": n, "depth": d, "sample": s}
        for n in lengths
        for d in depths
        for s in range(samples)
        for spec in specs
    ]


class NeedleBench:
    """``measure_cell`` of the needle grid: the passkey at ``depth`` of a ``length``-token prompt.

    Correct means the passkey's digits appear in the answer (spaces and commas removed), as in
    the passkey-retrieval evaluations (Mohtashami & Jaggi 2023); ``score`` is the same as 0/1.
    """

    def __init__(self, session, max_new_tokens: int = 16, seed: int = 0) -> None:
        self.session, self.max_new_tokens, self.seed = session, max_new_tokens, seed
        self._case: tuple | None = None

    def case(self, cell: dict):
        key = (cell["haystack"], cell["length"], cell["depth"], cell["sample"])
        if self._case is None or self._case[0] != key:
            n_doc = cell["length"] - PROMPT_OVERHEAD
            seed = case_seed(self.seed, cell["length"], cell["depth"], cell["sample"])
            case = make_case(self.session.lm.tokenizer, n_doc, cell["depth"], seed=seed, haystack=cell["haystack"])
            doc = document_from_text(case.text, source=f"needle-{cell['length']}-{cell['depth']}")
            self._case = (key, case, doc)
        return self._case[1], self._case[2]

    def __call__(self, cell: dict) -> dict:
        case, document = self.case(cell)
        result = ask(self.session, document, case.question, pipeline(cell["method"]), self.max_new_tokens)
        correct = case.is_correct(result.answer)
        return {
            "key": case.key,
            "answer": result.answer,
            "correct": correct,
            "score": float(correct),
            **result_fields(result),
        }


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def _stat_means(group: list[dict]) -> dict:
    out = {}
    for name in STAT_COLUMNS:
        out[name] = _mean(r.get("method_stats", {}).get(name) for r in group)
    return out


def summary(rows: list[dict], baseline: str = "full") -> list[dict]:
    """One entry per (length, method): accuracy, mean TTFT, TTFT / TTFT(baseline), peak memory.
    Rows with an ``error`` count as cases, not as correct, and have no timings."""
    out = []
    keys = list(dict.fromkeys((r["length"], r["method"]) for r in rows))
    for length, method in keys:
        group = [r for r in rows if r["length"] == length and r["method"] == method]
        ok = [r for r in group if not r.get("error")]
        base = [r for r in rows if r["length"] == length and r["method"] == baseline and not r.get("error")]
        ttft = _mean(r["ttft_s"] for r in ok)
        base_ttft = _mean(r["ttft_s"] for r in base)
        out.append(
            {
                "length": length,
                "method": method,
                "correct": sum(bool(r.get("correct")) for r in group),
                "cases": len(group),
                "errors": len(group) - len(ok),
                "ttft_s": ttft,
                "ttft_ratio": ttft / base_ttft if ttft is not None and base_ttft else None,
                "peak_mem_mb": max((r["peak_mem_mb"] for r in ok), default=None),
                "kv_cache_mb": _mean(r["kv_cache_mb"] for r in ok),
                "n_kept_tokens": round(_mean(r["n_kept_tokens"] for r in ok) or 0),
                "n_context_tokens": round(_mean(r["n_context_tokens"] for r in ok) or 0),
                **_stat_means(ok),
            }
        )
    return out


def table_cell(value, fmt: str, missing: str = "—") -> str:
    """A table's cell: ``value`` formatted, or ``missing`` for None."""
    return missing if value is None else format(value, fmt)


def markdown_table(entries: list[dict]) -> str:
    """The detailed table: one line per (length, method)."""
    head = "| tokens | method | needle | TTFT s | TTFT / full | peak MiB | KV MiB | kept |\n|---:|---|---:|---:|---:|---:|---:|---:|"
    lines = [head]
    for e in entries:
        lines.append(
            f"| {e['n_context_tokens']:,} | `{e['method']}` | {e['correct']}/{e['cases']} | {table_cell(e['ttft_s'], '.2f')} "
            f"| {table_cell(e['ttft_ratio'], '.2f')} | {table_cell(e['peak_mem_mb'], ',.0f')} | {table_cell(e['kv_cache_mb'], '.1f')} | {e['n_kept_tokens']:,} |"
        )
    return "\n".join(lines)


def length_label(n: int) -> str:
    """1024 -> 1k, 8000 -> 8k, 1500 -> 1,500 (the figures' axis labels)."""
    for unit in (1024, 1000):
        if n % unit == 0:
            return f"{n // unit}k"
    return f"{n:,}"


def needle_table(rows: list[dict], baseline: str = "full") -> str:
    """Accuracy per method x length (Markdown), with the mean TTFT ratio vs ``baseline`` when it
    ran, the mean KV cache, and the methods' own counters when they report them."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lengths = sorted(dict.fromkeys(r["length"] for r in rows))
    entries = {(e["method"], e["length"]): e for e in summary(rows, baseline)}
    has_base = any(r["method"] == baseline for r in rows)
    stats = [name for name in STAT_COLUMNS if any(name in r.get("method_stats", {}) for r in rows)]
    head = ["method", *(length_label(n) for n in lengths), "all"]
    head += ["TTFT / full"] if has_base else []
    head += ["TTFT s", "KV MiB", *(STAT_COLUMNS[s] for s in stats)]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for method in methods:
        group = [entries[(method, n)] for n in lengths if (method, n) in entries]
        cells = []
        for n in lengths:
            e = entries.get((method, n))
            cells.append(
                "" if e is None else f"{e['correct']}/{e['cases']}" + (f" ({e['errors']} err)" if e["errors"] else "")
            )
        correct, cases = sum(e["correct"] for e in group), sum(e["cases"] for e in group)
        cells.append(f"{correct}/{cases} ({correct / cases:.0%})" if cases else "")
        if has_base:
            cells.append(table_cell(_mean(e["ttft_ratio"] for e in group), ".2f"))
        cells.append(table_cell(_mean(e["ttft_s"] for e in group), ".2f"))
        cells.append(table_cell(_mean(e["kv_cache_mb"] for e in group), ".1f"))
        cells += [table_cell(_mean(e[s] for e in group), ".2f") for s in stats]
        lines.append(f"| `{method}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def select_rows(rows: list[dict], **wanted) -> list[dict]:
    """Rows whose fields are in the wanted collections (``method=[...]``, ``length=[...]``), in the
    order of ``method`` when given."""
    out = [r for r in rows if all(v is None or r.get(k) in v for k, v in wanted.items())]
    if wanted.get("method"):
        order = {m: i for i, m in enumerate(wanted["method"])}
        out.sort(key=lambda r: order.get(r["method"], len(order)))
    return out
