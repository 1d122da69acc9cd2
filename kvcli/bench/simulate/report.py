"""The simulated memory grid: its cells, the Markdown table of ``memory.json``, and the memory targets (simulated Llama-3.1-8B, nf4)
checked against the rows."""

from __future__ import annotations

from ...caches.quant import AUTO
from ..runner import length_label

GIB = 2**30
KV_BITS_LIMITS = {8: 15, 4: 11.5}  # GiB: full attention at 128k with 8/4-bit KV (16-bit: 23)


def memory_cells(configs, weights, specs, lengths, kv_offload: str = "none", kv_bits=(AUTO,)) -> list[dict]:
    """Config-major, then weights, then KV bits, then length, then method. ``kv_bits``: settings of
    ``--kv-bits`` (16, 8, 4 or auto, the product's default), each cell at the bits its method holds
    with that setting (:func:`cell_bits`: auto is 8 or 16 by method), a cell once however many
    settings give it. ``kv_bits`` is in a cell only where it is not 16 (the rows of a grid simulated
    before --kv-bits keep their keys)."""
    cells = [
        {"config": c, "weights": w, "method": m, "tokens": n, "kv_offload": kv_offload, **bits_key(cell_bits(m, b))}
        for c in configs
        for w in weights
        for b in kv_bits
        for n in lengths
        for m in specs
    ]
    return list({tuple(sorted(c.items())): c for c in cells}.values())


def cell_bits(method: str, setting: int | str = AUTO) -> int:
    """The bits ``method`` holds its KV in with ``--kv-bits setting`` (auto: as ``kvcli ask`` decides,
    :meth:`~kvcli.answer.pipeline.Pipeline.kv_bits`)."""
    from ...answer.pipeline import Pipeline

    return Pipeline.parse(method).kv_bits(setting)


def bits_key(b: int) -> dict:
    """A row's or cell's ``kv_bits`` key: absent at 16."""
    return {} if b == 16 else {"kv_bits": b}


def bits_of(row: dict) -> int:
    return row.get("kv_bits", 16)


def at_default_bits(rows: list[dict]) -> list[dict]:
    """Each method's rows at its default precision (``--kv-bits auto``), or at 16 bits where a cell was
    not simulated at it (a grid run with ``--kv-bits 16``, the rows recorded before auto was the default)."""
    auto = {m: cell_bits(m) for m in {r["method"] for r in rows}}
    simulated = {(r["method"], r["tokens"], r.get("kv_offload", "none"), bits_of(r)) for r in rows}
    return [
        r
        for r in rows
        if bits_of(r) == auto[r["method"]]
        or (
            bits_of(r) == 16
            and (r["method"], r["tokens"], r.get("kv_offload", "none"), auto[r["method"]]) not in simulated
        )
    ]


def _gib(v) -> str:
    return "—" if v is None else f"{v / GIB:.2f}"


def _n(v) -> str:
    return "—" if v is None else f"{v:g}"


def memory_table(rows: list[dict]) -> str:
    """Markdown: one line per row; sizes in GiB (2^30 bytes)."""
    head = (
        "| config | weights | method | tokens | offload | peak GiB | weights GiB | KV GiB | held after prefill GiB "
        "| syncs / decode step | h2d / decode step | syncs / prefill layer | SDPA math calls (prefill) | reads answered | error |"
    )
    lines = [head, "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        math = (r.get("sdpa_backends") or {}).get("prefill", {}).get("math", 0)
        error = (r.get("error") or "").replace("|", "\\|")
        lines.append(
            f"| {r['config']} | {r['weights']} | `{r['method']}`{_bits_label(r)} | {length_label(r['tokens'])} | {r.get('kv_offload', 'none')} "
            f"| {_gib(r.get('peak_bytes')) if not error else '—'} | {_gib(r.get('weights_bytes'))} | {_gib(r.get('kv_bytes'))} "
            f"| {_gib(r.get('held_after_prefill_bytes'))} | {_n(r.get('syncs_per_decode_step'))} "
            f"| {_n(r.get('h2d_copies_per_decode_step'))} | {_n(r.get('syncs_per_prefill_layer'))} | {math} | {r.get('reads_answered', 0)} | {error} |"
        )
    return "\n".join(lines)


def _bits_label(row: dict) -> str:
    return "" if bits_of(row) == 16 else f" ({bits_of(row)}-bit KV)"


# the methods whose decoding the targets check: Llama-3.1-8B, nf4 weights
DECODE_METHODS = ("full", "snapkv", "pyramidkv", "streamingllm", "gemfilter", "finch", "razor")


def _find(rows, method, tokens, offload="none", kv_bits=16):
    base = method.split(":")[0]
    rows = [r for r in rows if bits_of(r) == kv_bits]
    exact = [
        r for r in rows if r["method"] == method and r["tokens"] == tokens and r.get("kv_offload", "none") == offload
    ]
    return (
        exact[0]
        if exact
        else next(
            (
                r
                for r in rows
                if r["method"].split(":")[0] == base
                and r["tokens"] == tokens
                and r.get("kv_offload", "none") == offload
            ),
            None,
        )
    )


def targets(rows: list[dict], long: int = 131072, short: int = 32768) -> list[dict]:
    """The memory targets (simulated Llama-3.1-8B, nf4: each peak and its limit, below) against ``rows``: what, limit, measured, met."""
    rows = [r for r in rows if r["config"] == "llama-3.1-8b" and r["weights"] == "nf4"]
    out = []

    def peak(what, method, tokens, limit_gib, offload="none", kv_bits=16):
        r = _find(rows, method, tokens, offload, kv_bits)
        value = None if r is None or r.get("error") else r["peak_bytes"] / GIB
        out.append(
            {
                "target": what,
                "limit": f"<= {limit_gib} GiB",
                "measured": "not run" if r is None else (r.get("error") or f"{value:.2f} GiB"),
                "met": value is not None and value <= limit_gib,
            }
        )

    peak(f"full attention, {length_label(long)}", "full", long, 23)
    peak(f"GemFilter, {length_label(long)}", "gemfilter", long, 14)
    peak(f"Finch target=4096, {length_label(long)}", "finch:target=4096", long, 9)
    peak(f"block-sparse + --kv-offload cpu, {length_label(long)}", "blocksparse", long, 9, offload="cpu")
    for bits, limit in KV_BITS_LIMITS.items():  # --kv-bits (issue 40): where such rows were simulated
        if any(bits_of(r) == bits for r in rows):
            peak(f"full attention, {length_label(long)}, {bits}-bit KV", "full", long, limit, kv_bits=bits)
    rows = at_default_bits(rows)  # the rest: each method as kvcli ask runs it (--kv-bits auto)
    short_rows = [r for r in rows if r["tokens"] == short and r.get("kv_offload", "none") == "none"]
    over = [
        f"{r['method']} ({'error' if r.get('error') else format(r['peak_bytes'] / GIB, '.2f') + ' GiB'})"
        for r in short_rows
        if r.get("error") or r["peak_bytes"] > 12 * GIB
    ]
    out.append(
        {
            "target": f"every method, {length_label(short)}",
            "limit": "<= 12 GiB",
            "measured": f"{len(short_rows) - len(over)}/{len(short_rows)} methods within"
            + (f"; over or failed: {', '.join(over)}" if over else ""),
            "met": bool(short_rows) and not over,
        }
    )
    for method in DECODE_METHODS:
        r = (
            _find(rows, method, long)
            or _find(rows, method, short)
            or next(
                (x for x in rows if x["method"].split(":")[0] == method and x.get("kv_offload", "none") == "none"), None
            )
        )
        if r is None:
            out.append(
                {"target": f"{method}: decode syncs <= 1, h2d = 0", "limit": "", "measured": "not run", "met": False}
            )
            continue
        s, h = r.get("syncs_per_decode_step"), r.get("h2d_copies_per_decode_step")
        measured = r["error"] if r.get("error") else f"{s} syncs, {h} h2d per step ({length_label(r['tokens'])})"
        out.append(
            {
                "target": f"{method}: decode syncs <= 1, h2d = 0",
                "limit": "<= 1 / 0",
                "measured": measured,
                "met": not r.get("error") and s is not None and s <= 1 and h == 0,
            }
        )
    return out


def targets_table(checks: list[dict]) -> str:
    lines = ["| target | limit | measured | met |", "|---|---|---|---|"]
    for c in checks:
        lines.append(
            f"| {c['target']} | {c['limit']} | {str(c['measured']).replace('|', '/')} | {'yes' if c['met'] else 'no'} |"
        )
    return "\n".join(lines)
