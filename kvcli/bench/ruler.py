"""RULER (Hsieh et al., 2024, arXiv:2404.06654) as NVIDIA kvpress's leaderboard runs it, on kvcli.

The tasks and their instances are :mod:`kvcli.bench.ruler_tasks`; this module scores the answers,
maps the compression ratios onto the methods, runs the cells and makes the tables.

**Scoring** is RULER's: the answer, stripped and with control characters turned into newlines, is
scored ``string_match_all`` (niah, vt, cwe, fwe: the share of the references found in it, case
insensitive) or ``string_match_part`` (qa: 1 if any reference is found), × 100.

**Compression ratios** (``--ratios 2,4,8``, kvpress-leaderboard style: ratio r keeps ~1/r of the
prompt's KV) map onto each method in :func:`spec_at_ratio`:

* ``snapkv``, ``pyramidkv``, ``h2o``, ``streamingllm``: ``budget=1/r`` (a ratio of the prompt).
* ``gemfilter``: ``k=round(n/r)`` for each instance's prompt of ``n`` tokens (``k`` is a count; the
  question tokens it always keeps are part of ``k``); ``k=1/r`` once its ``k`` accepts a ratio.
* ``finch``: ``target=1/r`` once its ``target`` accepts a ratio, else ``target=round(n/r) - q``
  per instance (``q`` = question + template tokens, which Finch keeps on top of its target).
* ``full`` is the ceiling (ratio 1). ``razor`` (its compression follows from the model's retrieval
  heads: ~1.6-2.5× on SmolLM2), ``lazyllm`` (prunes computation, keeps the KV) and ``blocksparse``
  (keeps the whole KV, attends a few blocks) have no budget to set: they run once at their own
  defaults, as does any spec that sets the ratio's knob itself (``snapkv:budget=256``) or chains
  methods; the table and the plot show their measured ratio.

Every cell records the measured ``compression_ratio`` and ``n_kept_tokens`` of
:func:`kvcli.report.record.result_record`, whatever the nominal ratio.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass
from functools import cache

from ..answer.pipeline import Pipeline
from ..documents import document_from_text
from ..errors import KvcliError, UsageError
from .ruler_tasks import TASK_NAMES, TASKS, Instance, make_instance
from .runner import length_label, table_cell

RULER_KEY = ("model", "seed", "task", "length", "index", "method", "ratio")

# --------------------------------------------------------------------------- scoring (RULER's eval)


def postprocess(prediction: str | None) -> str:
    """RULER's ``postprocess_pred``: strip; control characters become newlines."""
    if prediction is None:
        return ""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: list[str]) -> float:
    """Share of the references found in the prediction (case-insensitive), × 100."""
    found = [r.lower() in prediction.lower() for r in references]
    return 100.0 * sum(found) / len(found)


def string_match_part(prediction: str, references: list[str]) -> float:
    """100 when any reference is found in the prediction (case-insensitive), else 0."""
    return 100.0 * max(r.lower() in prediction.lower() for r in references)


def score_answer(task: str, prediction: str, references: list[str]) -> float:
    metric = string_match_part if TASKS[task].metric == "part" else string_match_all
    return metric(postprocess(prediction), references)


# --------------------------------------------------------------------------- compression ratios

# the knob of each method that sets how much it keeps (a ratio of the prompt, or a token count)
RATIO_KNOBS = {
    **{
        m: "budget"
        for m in (
            "snapkv",
            "pyramidkv",
            "h2o",
            "streamingllm",
            "tova",
            "knorm",
            "keydiff",
            "adakv",
            "expectedattention",
            "kvzip",
        )
    },
    "gemfilter": "k",
    "finch": "target",
}


def parse_ratios(text: str | None) -> list[float]:
    """``"2,4,8"`` -> [2.0, 4.0, 8.0]; ``"none"`` or empty -> [] (every method at its own settings)."""
    if not text or text.strip().lower() == "none":
        return []
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--ratios: comma-separated compression ratios above 1, e.g. 2,4,8, not '{text}'") from None
    bad = [v for v in values if not (v > 1 and math.isfinite(v))]
    if bad or not values:
        raise UsageError(
            f"--ratios: every ratio must be above 1 (ratio r keeps 1/r of the KV; 1 is full attention), got '{text}'"
        )
    return sorted(dict.fromkeys(values))


def swept(spec: str) -> bool:
    """Whether ``--ratios`` applies to ``spec``: one method with a ratio knob it does not set itself."""
    stages = Pipeline.parse(spec).stages
    return (
        len(stages) == 1
        and stages[0].name in RATIO_KNOBS
        and RATIO_KNOBS[stages[0].name] not in stages[0].explicit_knobs
    )


@cache
def accepts_ratio(method: str, knob: str) -> bool:
    """Whether ``method``'s ``knob`` takes a ratio of the prompt (0 < x < 1) as well as a count."""
    try:
        Pipeline.parse(f"{method}:{knob}=0.5")
        return True
    except UsageError:
        return False


def spec_at_ratio(spec: str, ratio: float | None, n_prompt: int, n_suffix: int = 0) -> str:
    """The spec that runs ``spec`` at compression ``ratio`` on a prompt of ``n_prompt`` tokens
    (``n_suffix`` of them after the document). The one place ratios meet methods:

    * a ratio knob (``budget`` of the eviction methods; ``k``/``target`` when they accept one):
      ``1/ratio``;
    * a count (``gemfilter:k``, ``finch:target``): ``round(n_prompt / ratio)`` tokens, less the
      question tokens for Finch, which keeps them on top of its target; at least 1.

    ``ratio`` None, or a spec :func:`swept` does not apply to: ``spec`` itself.
    """
    if ratio is None or not swept(spec):
        return spec
    name = Pipeline.parse(spec).stages[0].name
    knob = RATIO_KNOBS[name]
    if accepts_ratio(name, knob):
        value = f"{1 / ratio:.6g}"
    else:
        kept = n_prompt / ratio - (n_suffix if name == "finch" else 0)
        value = str(max(1, round(kept)))
    return f"{spec}{',' if ':' in spec else ':'}{knob}={value}"


def ruler_cells(
    specs: list[str], ratios: list[float], tasks: list[str], lengths: list[int], samples: int, seed: int = 0
) -> list[dict]:
    """Length-major, then task, then sample, then method (each ratio of a method in turn): every
    method reads an instance right after it is built, while its prefix KV is in the store."""
    runs = [(spec, r) for spec in specs for r in (ratios if ratios and swept(spec) else [None])]
    return [
        {"seed": seed, "task": task, "length": n, "index": i, "method": spec, "ratio": r}
        for n in lengths
        for task in tasks
        for i in range(samples)
        for spec, r in runs
    ]


def unswept(specs: list[str]) -> list[str]:
    return [s for s in specs if not swept(s) and s != "full"]


# --------------------------------------------------------------------------- the measured cell


class RulerBench:
    """``measure_cell`` of the RULER grid: one :meth:`Session.ask` per cell, with the disk store
    ``store`` (a bench-specific one) so that full attention's prefix KV serves SnapKV, PyramidKV
    and StreamingLLM at every ratio. Entries of an instance are removed when the next begins."""

    def __init__(self, session, seed: int = 0, store=None) -> None:
        self.session, self.seed, self.store = session, seed, store
        self._current: tuple | None = None

    def instance(self, cell: dict) -> tuple[Instance, object]:
        key = (cell["task"], cell["length"], cell["index"], cell["seed"])
        if self._current is None or self._current[0] != key:
            self.clear_store()
            try:
                inst = make_instance(
                    self.session.lm.tokenizer,
                    cell["task"],
                    cell["length"],
                    cell["index"],
                    cell["seed"],
                    self.session.template,
                )
                doc = document_from_text(inst.document, source=f"ruler-{cell['task']}-{cell['length']}-{cell['index']}")
                self._current = (key, inst, doc)
            except KvcliError as e:  # every method's cell of this instance fails the same way, at once
                self._current = (key, e, None)
        if isinstance(self._current[1], KvcliError):
            raise self._current[1]
        return self._current[1], self._current[2]

    def clear_store(self) -> None:
        if self.store is not None:
            self.store.prune(0)

    def close(self) -> None:
        """Empty the store and remove its folders (when nothing else is in them)."""
        self.clear_store()
        if self.store is not None:
            for folder in (self.store.root / "locks", self.store.root, self.store.root.parent):
                try:
                    folder.rmdir()
                except OSError:
                    break

    def __call__(self, cell: dict) -> dict:
        from ..answer.question import QuestionOptions
        from ..report.record import result_record

        inst, doc = self.instance(cell)
        spec = spec_at_ratio(cell["method"], cell["ratio"], inst.n_prompt_tokens, inst.n_suffix_tokens)
        pipeline = Pipeline.parse(spec)
        result = self.session.ask(
            doc,
            inst.question,
            pipeline,
            QuestionOptions(max_new_tokens=inst.max_new_tokens, answer_prefix=inst.answer_prefix, check=False),
        )
        record = result_record(result, self.session, pipeline, doc)
        return {
            "spec": spec,
            "compressor": record["compressor"],
            "score": score_answer(cell["task"], record["answer"], inst.outputs),
            "answer": record["answer"],
            "outputs": inst.outputs,
            "max_new_tokens": inst.max_new_tokens,
            "compression_ratio": record["compression_ratio"],
            "n_kept_tokens": record["n_kept_tokens"],
            "n_context_tokens": record["n_context_tokens"],
            "n_document_tokens": record["n_document_tokens"],
            "n_answer_tokens": record["n_answer_tokens"],
            "ttft_s": record["ttft_s"],
            "total_s": record["total_s"],
            "peak_mem_mb": record["peak_mem_mb"],
            "kv_cache_mb": (record["kv_cache_bytes"] or 0) / 2**20,
            "cache": record["cache"],
            "method_stats": record["method_stats"],
            "warnings": record["warnings"],
        }


# --------------------------------------------------------------------------- tables


def run_label(method: str, ratio: float | None) -> str:
    return method if ratio is None else f"{method} ×{ratio:g}"


def method_runs(rows: list[dict]) -> list[tuple[str, float | None]]:
    """(method, ratio) pairs in the order of the methods, ratios ascending (own settings first)."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    pairs = set((r["method"], r.get("ratio")) for r in rows)
    return [
        (m, r) for m in methods for r in sorted((r for mm, r in pairs if mm == m), key=lambda x: -1 if x is None else x)
    ]


@dataclass
class Score:
    mean: float  # errors count as 0, as a null prediction does in RULER
    cases: int
    errors: int

    def text(self) -> str:
        return f"{self.mean:.1f}" + (f" ({self.errors} err)" if self.errors else "")


def _score(group: list[dict]) -> Score | None:
    if not group:
        return None
    return Score(
        statistics.mean(float(r.get("score") or 0.0) for r in group),
        len(group),
        sum(bool(r.get("error")) for r in group),
    )


def task_scores(rows: list[dict]) -> dict[tuple, Score]:
    """(length, method, ratio, task) -> mean score over the samples."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["length"], r["method"], r.get("ratio"), r["task"]), []).append(r)
    return {k: _score(v) for k, v in groups.items()}


def average_scores(rows: list[dict]) -> dict[tuple, float]:
    """(length, method, ratio) -> mean over tasks of the task means (RULER's average)."""
    per_task = task_scores(rows)
    out: dict[tuple, list[float]] = {}
    for (n, m, r, _), s in per_task.items():
        out.setdefault((n, m, r), []).append(s.mean)
    return {k: statistics.mean(v) for k, v in out.items()}


def measured_ratios(rows: list[dict]) -> dict[tuple, float]:
    """(method, ratio) -> mean measured ``compression_ratio`` of the cells that ran."""
    out: dict[tuple, list[float]] = {}
    for r in rows:
        if not r.get("error") and r.get("compression_ratio") is not None:
            out.setdefault((r["method"], r.get("ratio")), []).append(float(r["compression_ratio"]))
    return {k: statistics.mean(v) for k, v in out.items()}


def ruler_table(rows: list[dict]) -> str:
    """Markdown: the average per method × ratio and length, then per length the score of every task."""
    lengths = sorted(dict.fromkeys(r["length"] for r in rows))
    tasks = [t for t in TASK_NAMES if any(r["task"] == t for r in rows)]
    runs = method_runs(rows)
    per_task, averages, measured = task_scores(rows), average_scores(rows), measured_ratios(rows)

    def ratio_cells(m, r):
        return ["—" if r is None else f"{r:g}", table_cell(measured.get((m, r)), ".2f")]

    head = ["method", "ratio", "measured", *(length_label(n) for n in lengths), "avg"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for m, r in runs:
        values = [averages.get((n, m, r)) for n in lengths]
        present = [v for v in values if v is not None]
        overall = statistics.mean(present) if present else None
        lines.append(
            f"| `{m}` | "
            + " | ".join(
                [*ratio_cells(m, r), *(table_cell(v, ".1f", "") for v in values), table_cell(overall, ".1f", "")]
            )
            + " |"
        )
    for n in lengths:
        head = ["method", "ratio", *tasks, "avg"]
        lines += [
            "",
            f"**{length_label(n)}** ({n:,} tokens): score per task (RULER's string match × 100, mean of the samples)",
            "",
        ]
        lines += ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
        for m, r in runs:
            if (n, m, r) not in averages:
                continue
            cells = [per_task[(n, m, r, t)].text() if (n, m, r, t) in per_task else "" for t in tasks]
            lines.append(
                f"| `{m}` | {'—' if r is None else f'{r:g}'} | " + " | ".join(cells) + f" | {averages[(n, m, r)]:.1f} |"
            )
    return "\n".join(lines)
