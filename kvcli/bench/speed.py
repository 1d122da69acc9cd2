"""TTFT, decode speed and peak memory vs context length, per method (the papers' speed curves).

Each cell (method, length) answers the passkey question about a needle document of ``length``
tokens (needle at depth 0.5, so every method reads the same text) with no disk cache, generating
exactly ``new_tokens`` tokens (stop tokens are ignored, so decode tokens/s always measures the
same number of steps). With ``repeat`` > 1 the cell runs that many times and the row reports the
median of each measure (the single runs are kept in ``runs``).
"""

from __future__ import annotations

import statistics

from ..documents import document_from_text
from .needle import make_case
from .runner import PROMPT_OVERHEAD, STAT_COLUMNS, ask, pipeline, result_fields, table_cell

SPEED_KEY = ("model", "haystack", "method", "length", "new_tokens")
MEASURES = ("ttft_s", "total_s", "decode_tokens_per_s", "peak_mem_mb", "kv_cache_mb")


def speed_cells(specs, lengths, new_tokens: int, haystack: str = "essays") -> list[dict]:
    return [
        {"haystack": haystack, "method": spec, "length": n, "new_tokens": new_tokens} for n in lengths for spec in specs
    ]


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


class SpeedBench:
    """``measure_cell`` of the speed grid."""

    def __init__(self, session, repeat: int = 1, seed: int = 0) -> None:
        self.session, self.repeat, self.seed = session, max(1, repeat), seed
        self._docs: dict[tuple, tuple] = {}

    def document(self, length: int, haystack: str):
        key = (length, haystack)
        if key not in self._docs:
            case = make_case(
                self.session.lm.tokenizer, length - PROMPT_OVERHEAD, 0.5, seed=self.seed, haystack=haystack
            )
            self._docs = {key: (case, document_from_text(case.text, source=f"speed-{length}"))}
        return self._docs[key]

    def __call__(self, cell: dict) -> dict:
        case, document = self.document(cell["length"], cell.get("haystack", "essays"))
        runs = []
        for _ in range(self.repeat):
            result = ask(
                self.session,
                document,
                case.question,
                pipeline(cell["method"]),
                cell["new_tokens"],
                force_tokens=True,
            )
            runs.append(result_fields(result))
        row = {**runs[-1], "repeat": self.repeat}
        for name in MEASURES:
            row[name] = _median(r[name] for r in runs)
        row["runs"] = [{name: r[name] for name in MEASURES} for r in runs]
        return row


def speed_table(rows: list[dict], baseline: str = "full") -> str:
    """Markdown: one line per (length, method): TTFT, TTFT / full, the whole generation's time (the
    prompt and every new token) and its ratio to full's, decode tokens/s, peak and KV MiB, and the
    methods' own counters (LazyLLM: the share of (prompt token, layer) pairs computed by the end,
    the paper's Table 2)."""
    stats = [name for name in STAT_COLUMNS if any(name in r.get("method_stats", {}) for r in rows)]
    head = [
        "tokens",
        "method",
        "TTFT s",
        "TTFT / full",
        "total s",
        "total / full",
        "decode tok/s",
        "peak MiB",
        "KV MiB",
        *(STAT_COLUMNS[s] for s in stats),
    ]
    lines = ["| " + " | ".join(head) + " |", "|---:|---|" + "---:|" * (len(head) - 2)]
    base = {r["length"]: r for r in rows if r["method"] == baseline and not r.get("error")}
    for r in sorted(rows, key=lambda r: r["length"]):  # stable: methods keep their order
        if r.get("error"):
            lines.append(f"| {r['length']:,} | `{r['method']}` | error: {r['error']} |" + " |" * (len(head) - 3))
            continue
        full = base.get(r["length"])
        ratio = r["ttft_s"] / full["ttft_s"] if full and full["ttft_s"] else None
        total = r.get("total_s")  # None in a results file from before it was a column
        total_ratio = total / full["total_s"] if total and full and full.get("total_s") else None
        cells = [
            f"{r['n_context_tokens']:,}",
            f"`{r['method']}`",
            table_cell(r["ttft_s"], ".2f"),
            table_cell(ratio, ".2f"),
            table_cell(total, ".2f"),
            table_cell(total_ratio, ".2f"),
            table_cell(r["decode_tokens_per_s"], ".1f"),
            table_cell(r["peak_mem_mb"], ",.0f"),
            table_cell(r["kv_cache_mb"], ".1f"),
            *(table_cell(r.get("method_stats", {}).get(s), ".2f") for s in stats),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
