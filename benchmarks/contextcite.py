"""ContextCite (Cohen-Wang et al. 2024), the reference ranking benchmarks/cite.py scores kvcli's
sources against: which paragraphs of the document does full attention's answer depend on?

The document's paragraphs are the sources; random subsets of them (each paragraph kept with
probability 1/2) each give the log-probability of full attention's answer; a sparse linear
surrogate (Lasso) of it ranks the paragraphs. Used through ``python benchmarks/cite.py ruler
--methods contextcite``; not a command of its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from kvcli.answer.prompt import build_prompt
from kvcli.answer.question import QuestionOptions
from kvcli.cite.sources import Source, Sources


def lasso(x: np.ndarray, y: np.ndarray, alpha: float = 0.01, steps: int = 2000) -> np.ndarray:
    """ContextCite's surrogate: min 1/(2n) |y - x w - b|^2 + alpha |w|_1, by ISTA (x centred)."""
    xc, yc = x - x.mean(0), y - y.mean()
    step = len(x) / max(np.linalg.norm(xc, 2) ** 2, 1e-9)
    w = np.zeros(x.shape[1])
    for _ in range(steps):
        w = w - step * (xc.T @ (xc @ w - yc)) / len(x)
        w = np.sign(w) * np.maximum(np.abs(w) - step * alpha, 0.0)
    return w


@dataclass
class Ranked:
    result: object  # full attention's Result (its answer, its own sources)
    sources: Sources  # ContextCite's top three paragraphs with a positive weight
    agrees: bool  # the attention's top source overlaps ContextCite's top paragraph
    seconds: float  # the answer and every ablation


def answer_logprob(session, text: str, question: str, answer_prefix: str, answer: torch.Tensor) -> float:
    """log p(answer | the prompt over ``text``), one forward pass (no cache)."""
    prompt = build_prompt(session.lm.tokenizer, text, question, session.template, answer_prefix)
    ids = torch.cat([prompt.ids, answer])
    with torch.inference_mode():
        hidden = session.engine.forward(ids, torch.arange(ids.numel()), None)
        logits = session.engine.logits(hidden[:, prompt.n_tokens - 1 : -1])  # (answer, vocab)
    logp = torch.log_softmax(logits, -1)
    return float(logp[torch.arange(answer.numel()), answer].sum())


def ranking(session, doc, question: str, answer_prefix: str, max_new_tokens: int, ablations: int) -> Ranked:
    """Full attention answers; ``ablations`` random halves of the paragraphs rank them (seed 0)."""
    from kvcli.api import parse_pipeline

    t0 = time.perf_counter()
    result = session.ask(
        doc,
        question,
        parse_pipeline("full"),
        QuestionOptions(answer_prefix=answer_prefix, max_new_tokens=max_new_tokens),
    )
    answer = torch.tensor(result.answer_ids)
    cuts = doc.passages()
    masks = np.random.default_rng(0).random((ablations, len(cuts))) < 0.5
    logps = [
        answer_logprob(
            session,
            "\n\n".join(doc.text[lo:hi] for (lo, hi), keep in zip(cuts, mask) if keep) or " ",
            question,
            answer_prefix,
            answer,
        )
        for mask in masks
    ]
    w = lasso(masks.astype(np.float64), np.array(logps))
    order = np.argsort(-w, kind="stable")[:3]
    items = tuple(
        Source(cuts[i][0], cuts[i][1], 1, 1, False, doc.text[cuts[i][0] : cuts[i][1]], float(w[i]), ())
        for i in order
        if w[i] > 0
    )
    attention = result.sources.items[0] if result.sources and result.sources.items else None
    agrees = bool(items) and attention is not None and attention.start < items[0].end and items[0].start < attention.end
    return Ranked(result, Sources(items, clear=bool(items), signal="contextcite"), agrees, time.perf_counter() - t0)
