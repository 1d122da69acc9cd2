"""The JSON record of an answer (``kvcli ask --json``, each line of a batch, ``kvcli chat --json``,
the benchmarks' rows): :func:`result_record`, and what it derives from the result — the fractions a
method saves (:func:`compute_fractions`), what a stored book read (:func:`read_mask`) and what
``--show-selected`` shows (:func:`shown_selection`). Importing it imports no PyTorch (a command
that writes records imports it at its top; the functions import what they read)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import notices

if TYPE_CHECKING:
    import torch

    from ..answer.pipeline import Pipeline, Result
    from ..compressors.selection import Selection
    from ..documents import Document


def result_record(result: Result, session, pipeline: Pipeline, document: Document, include_spans: bool = False) -> dict:
    """The JSON object of ``kvcli ask --json``. ``session``: the :class:`kvcli.api.Session` that
    answered (its model's name, attention kernel and quantization, and its engine's device)."""
    from ..compressors.selection import read_record
    from ..model.names import spelled

    record = {
        "answer": result.answer,
        "compressor": result.extra.get("compressor", pipeline.spec()),
        "policy": result.extra.get("policy"),  # "auto" when the default policy chose the method
        "model": session.lm.name,
        "document": document.source,
        "n_pages": document.n_pages,
        "n_context_tokens": result.prompt.n_tokens,
        "n_document_tokens": result.prompt.n_document_tokens,
        # the KV actually held: mean over layers and KV heads of prompt entries in the cache
        "n_kept_tokens": round(result.n_kept_tokens, 2),
        # none for a method that retrieves (pages): what it read is in ``read``, and full attention
        # over the whole document, what a ratio compares with, may not fit the window
        "compression_ratio": None if result.selection.retrieved else round(result.compression_ratio, 4),
        "n_selected_tokens": result.selection.n_kept,  # prompt tokens the model read (a selector's k)
        **compute_fractions(result.extra.get("method_stats") or {}),
        "ttft_s": round(result.ttft_s, 4),
        "total_s": round(result.total_s, 4),
        "decode_tokens_per_s": None if result.decode_tokens_per_s is None else round(result.decode_tokens_per_s, 2),
        "peak_mem_mb": round(result.peak_mem_mb, 1),
        "threads": result.extra.get("threads"),  # phase -> its CPU threads, e.g. {"prefill": [2], "decode": [1]}
        **(
            {}
            if result.extra.get("peak_mem_reserved_mb") is None
            else {"peak_mem_reserved_mb": round(result.extra["peak_mem_reserved_mb"], 1)}
        ),  # CUDA
        "kv_cache_bytes": result.extra.get("kv_cache_bytes"),
        "kv_bits": result.extra.get("kv_bits"),  # bits the KV was held in (--kv-bits; 16 where a method keeps 16)
        "decode_kv_bits": result.extra.get("decode_kv_bits"),  # bits decoding read it in (16 under auto on a CPU)
        "n_answer_tokens": len(result.answer_ids),
        # drafts from the text read, checked a pass at a time (--lookup): passes, tokens drafted and
        # taken; null where decoding went a pass a token (kvcli.runtime.lookup)
        "lookup": result.extra.get("lookup"),
        "device": str(session.engine.device),
        "attn": session.lm.attn,
        "quant": spelled(session.lm.quant),  # as --quant spells it: none, 8, 4
        # 8-bit weights' decoding with 8-bit activations: the kernel's path (AVX-512 VNNI, AVX2); null: PyTorch's (exact activations)
        "int8_kernel": session.lm.int8_kernel,
        "cache": result.extra["cache"]["status"],
        "cache_saved_s": result.extra["cache"]["saved_s"],
        "cache_entry_bytes": result.extra["cache"]["entry_bytes"],
        "method_stats": result.extra.get("method_stats", {}),  # the method's own counters (cache.stats())
        # where the answer comes from, best first (null: --no-sources), and why there is none or no clear one
        "sources": None if result.sources is None else result.sources.to_json(),
        "sources_note": None if result.sources is None else result.sources.reason,
        "sources_s": None if result.sources is None else round(result.extra["sources_s"], 4),
        # a method that retrieves (pages): each passage read, with what ranked it as a source
        "sources_evidence": None if result.sources is None else result.sources.extra.get("evidence"),
        # whether the answer comes from the document: nats a token it gains from it (kvcli.answer.grounding); null: not checked
        "grounding": None if result.grounding is None else result.grounding.score,
        "grounded": None if result.grounding is None else result.grounding.grounded,
        "check_s": None if result.grounding is None else round(result.grounding.seconds, 4),
        # the model's log-odds of "yes" when asked whether the document supports its answer (the
        # models whose check asks: kvcli.answer.grounding); null: not asked
        "grounding_asked": None if result.grounding is None else result.grounding.asked,
        # a method that ranks passages (pages) and found none matching the question: that, and what it read instead
        "no_match": result.selection.note,
        # a method that retrieves (pages): the passages read whole and skimmed, their tokens, of the document's
        "read": read_record(
            result.selection.read, result.prompt, document, result.selection.ranked_by, result.selection.expansion
        ),
        "warnings": notices.drain(),  # said while loading or answering, since the last record
    }
    # each kept span (a stored book: the spans read, :func:`shown_selection`), and whether a source cites it
    if include_spans:
        cited = [] if result.sources is None else result.sources.items
        record["selected_spans"] = [
            {**s.to_json(), "cited": any(c.start < s.end and s.start < c.end for c in cited)}
            for s in shown_selection(result)[0].spans(result.prompt, document)
        ]
    return record


def compute_fractions(stats: dict) -> dict:
    """What a method saves besides the KV it holds, from its own counters: ``prompt_computed_frac``
    (LazyLLM: share of (prompt token, layer) pairs computed), ``kv_attended_frac`` (block-sparse
    retrieval: share of the KV each decoding step attended) and ``kv_read_frac`` (InfLLM's book:
    share of the KV the question and its whole answer read, :func:`read_mask`); None for methods
    that do none of these."""
    return {
        "prompt_computed_frac": stats.get("prompt_tokens_computed_frac"),
        "kv_attended_frac": stats.get("kv_attended_frac"),
        "kv_read_frac": None if stats.get("kv_read_frac") is None else round(stats["kv_read_frac"], 4),
    }


def read_mask(result: Result) -> torch.Tensor | None:
    """What each layer and KV head *read* of the prompt while answering, where the cache reads
    less than it holds (InfLLM's book: Initial, the retrieved blocks, Local), in prompt indices:
    (n_layers, n_kv_heads, n_prompt) bool; None where it read all it held (``Result.kept_mask``)."""
    import torch

    inner = None if result.cache is None else result.cache.read_mask(result.selection.n_kept)
    if inner is None:
        return None
    mask = torch.zeros(*inner.shape[:2], result.prompt.n_tokens, dtype=torch.bool)
    mask[:, :, result.selection.kept] = inner
    return mask


def shown_selection(result: Result) -> tuple[Selection, float, str]:
    """What ``--show-selected`` shows of an answer: (the tokens, how many per layer and KV head,
    "kept" or "read"). The tokens the model kept (a selector's choice; everything without one) —
    or, where the cache reads less than it holds (:func:`read_mask`), those the question and its
    answer read, scored by the share of (layer, KV head) pairs that read each."""
    import torch

    from ..compressors.selection import Selection

    read = read_mask(result)
    if read is None:
        return result.selection, float(result.selection.n_kept), "kept"
    tokens = torch.nonzero(read.any(dim=0).any(dim=0)).flatten()
    return Selection(tokens, read.float().mean(dim=(0, 1))), float(read.sum()) / (read.shape[0] * read.shape[1]), "read"


def question_record(source: str, question: str, record: dict) -> dict:
    """A line of a batch (``kvcli ask --questions``, several documents) or of ``kvcli chat --json``:
    the document as given (``source``, not the path read) and the question first, then the
    answer's :func:`result_record`."""
    return {"document": source, "question": question, **{k: v for k, v in record.items() if k != "document"}}
