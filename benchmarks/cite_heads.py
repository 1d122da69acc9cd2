"""Which attention heads say where an answer comes from: the measurement behind kvcli's citation heads.

    python benchmarks/cite_heads.py collect --instances 0-59 --out /tmp/cite-heads.npz
    python benchmarks/cite_heads.py analyze /tmp/cite-heads.npz --train 0-39

``collect``: RULER's ``qa_2`` (HotpotQA: the question's paragraphs among distractors, the gold
paragraphs known by their character offsets), in the model's window, answered greedily with full
attention by the model itself (a plain greedy loop over the transformers model with kvcli's attention
function). While it answers, an observer on every layer reads, for the query that writes each answer
token (the last prompt token's, then each decoding step's), its softmax attention over the keys of
the step, one layer and one step at a time, the query heads of a GQA group against their KV head;
the document tokens' weights are summed into the document's units (:mod:`kvcli.cite.sources`). The same
for the question's own tokens (the rows after the document in the prompt's pass). Kept per
instance: (layers, heads, units) for both, which units lie in a gold paragraph, the answer.

``analyze``: hit@1 / hit@3 of the top unit(s) per layer and head, per layer (heads summed), all
heads averaged, and per-head weights learned on the ``--train`` instances (AT2's lesson: a weight
per head beats averaging them) scored on the others.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvcli.answer.prompt import build_prompt, load_template  # noqa: E402
from kvcli.bench.ruler_tasks import make_instance  # noqa: E402
from kvcli.cite.sources import DocumentUnits  # noqa: E402
from kvcli.documents import document_from_text  # noqa: E402
from kvcli.model import load_model  # noqa: E402
from kvcli.model.facts import quant_name  # noqa: E402
from kvcli.runtime.attention import AttentionContext, attention_context, install  # noqa: E402
from kvcli.templates import stop_token_ids  # noqa: E402


def span(text: str) -> list[int]:
    """``0-39`` or ``0,3,5`` -> the indices."""
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


class Reader:
    """Per layer, the softmax weight of the observed query rows on each document token, summed over
    rows: ``answer`` (the last row of every pass: the query writing the next answer token) and
    ``question`` (the prompt pass's rows after the document)."""

    def __init__(self, n_layers: int, n_heads: int, doc: slice, after_doc: int) -> None:
        self.doc, self.after_doc = doc, after_doc
        n = doc.stop - doc.start
        self.answer = torch.zeros(n_layers, n_heads, n, dtype=torch.float64)
        self.question = torch.zeros(n_layers, n_heads, n, dtype=torch.float64)

    def observer(self, layer: int):
        def observe(query: torch.Tensor, key: torch.Tensor) -> None:
            _, h, q_len, d = query.shape
            kv_heads, kv_len = key.shape[1], key.shape[2]
            g = h // kv_heads
            k = key[0].float()  # (kv_heads, kv_len, d)
            rows = [(self.answer, query[0, :, -1:, :], kv_len - 1)]
            if q_len > 1:  # the prompt's pass: the question's rows too
                rows.append(
                    (self.question, query[0, :, kv_len - self.after_doc : kv_len - 1, :], kv_len - self.after_doc)
                )
            for acc, q, first_pos in rows:
                r = q.shape[1]
                logits = torch.einsum("kgrd,knd->kgrn", q.float().reshape(kv_heads, g, r, d), k) / d**0.5
                pos = torch.arange(kv_len)
                mask = pos[None, :] > (first_pos + torch.arange(r))[:, None]  # causal
                probs = logits.masked_fill(mask, float("-inf")).softmax(-1)
                acc[layer] += probs[..., self.doc].sum(2).reshape(h, -1).double()

        return observe


class PerHead:
    """``--per-head FILE``: besides the product's sources, each (layer, head)'s own attention per
    unit of every answer, kept in this module's format (``analyze`` learns and
    scores per-head weights on it). The citing heads are then every head of every layer."""

    def __init__(self, path: Path | None) -> None:
        self.path, self.records, self.arrays = path, [], {}
        self.current: torch.Tensor | None = None

    def install(self) -> None:
        import kvcli.answer.pipeline
        import kvcli.cite.attribution
        from kvcli.cite.attribution import CitingHeads, HeadWeights

        outer = self

        class Recording(CitingHeads):
            """Also each head's own weights, wherever the product adds a layer's (a step, or a
            batch of waiting steps at a flush): the layer being added is the one last observed
            or flushed."""

            def _observer(self, layer):
                inner = super()._observer(layer)

                def observe(query, key):
                    self.layer = layer
                    inner(query, key)

                return observe

            def flush(self, layer):
                self.layer = layer
                super().flush(layer)

            def add(self, positions, probs, weights):
                super().add(positions, probs, weights)
                if outer.current is None:
                    return
                n_kv, group, _ = probs.shape
                pos = positions.cpu()
                ok = (pos >= 0) & (pos < self.n_positions)
                for kv in range(n_kv):
                    for g in range(group):
                        row = probs[kv, g].cpu().float()
                        outer.current[self.layer, kv * group + g].index_add_(0, pos[kv][ok[kv]], row[ok[kv]])

        kvcli.answer.pipeline.CitingHeads = Recording
        kvcli.cite.attribution.citing_heads = lambda lm: HeadWeights.uniform(
            lm.n_layers, lm.n_heads, list(range(lm.n_layers)), "every head of every layer, averaged"
        )

    def start(self, lm, n_prompt: int) -> None:
        self.current = torch.zeros(lm.n_layers, lm.n_heads, n_prompt)

    def keep(self, case: dict, result, index: int, is_gold, right: bool) -> None:
        """One answer's record; ``is_gold(source dict)``: does a unit hold the answer; ``right``: the answer."""
        du = DocumentUnits.of(case["doc"])
        p = result.prompt
        per = self.current[:, :, p.doc_start : p.doc_end].numpy()
        units = np.stack(
            [[du.scores(p.doc_offsets, per[layer, h])[0] for h in range(per.shape[1])] for layer in range(per.shape[0])]
        )
        gold = []
        for i, u in enumerate(du.units):
            src = {
                "start": u.start,
                "end": u.end,
                **({"pages": list(case["doc"].page_range(u.start, u.end))} if "gold_pages" in case else {}),
            }
            if is_gold(src):
                gold.append(i)
        self.records.append(
            {
                "index": index,
                "document": case["document"],
                "question": case["question"],
                "gold": gold,
                "n_units": len(du),
                "right": right,
                "unit_chars": [u.end - u.start for u in du.units],
            }
        )
        self.arrays[f"answer_{index}"] = units.astype(np.float32)
        self.current = None

    def save(self) -> None:
        if self.path is not None and self.records:
            np.savez_compressed(self.path, records=json.dumps(self.records), **self.arrays)


def greedy(lm, ids: torch.Tensor, ctx: AttentionContext, max_new: int, stop: set[int]) -> list[int]:
    model = lm.model
    kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    answer: list[int] = []
    with torch.inference_mode(), attention_context(ctx):
        out = model(ids.view(1, -1), use_cache=True)
        past = out.past_key_values
        for _ in range(max_new):
            token = int(out.logits[0, -1].argmax())
            if token in stop:
                break
            answer.append(token)
            out = model(torch.tensor([[token]]), **{kwarg: past}, use_cache=True)
            past = out.past_key_values
    return answer


def collect(args) -> None:
    lm = load_model(None, quant=quant_name(args.quant) or args.quant)  # --quant 8, as kvcli spells it
    install(lm.model)  # kvcli's attention function, which calls the observers (the Engine installs it)
    tok = lm.tokenizer
    template = load_template("ruler")
    stop = stop_token_ids(tok, lm.model.generation_config)
    n_layers, n_heads = lm.model.config.num_hidden_layers, lm.model.config.num_attention_heads
    records, answer_scores, question_scores = [], [], []
    for index in span(args.instances):
        t0 = time.perf_counter()
        inst = make_instance(tok, args.task, args.length, index, seed=0)
        doc = document_from_text(inst.document, source=f"ruler-{args.task}")
        prompt = build_prompt(tok, doc.text, inst.question, template, inst.answer_prefix)
        reader = Reader(n_layers, n_heads, slice(prompt.doc_start, prompt.doc_end), prompt.n_after_document)
        ctx = AttentionContext(observers={i: [reader.observer(i)] for i in range(n_layers)})
        answer_ids = greedy(lm, prompt.ids, ctx, inst.max_new_tokens, stop)
        du = DocumentUnits.of(doc)
        gold = np.array([any(u.start < e and s < u.end for s, e in inst.spans) for u in du.units])
        per_unit = [
            np.stack(
                [
                    [du.scores(prompt.doc_offsets, acc[layer, head].numpy())[0] for head in range(n_heads)]
                    for layer in range(n_layers)
                ]
            )
            for acc in (reader.answer, reader.question)
        ]
        answer = tok.decode(answer_ids, skip_special_tokens=True)
        right = any(o.lower() in answer.lower() for o in inst.outputs)
        records.append(
            {
                "index": index,
                "answer": answer,
                "outputs": inst.outputs,
                "right": right,
                "n_units": len(du),
                "gold": np.flatnonzero(gold).tolist(),
                "n_tokens": prompt.n_tokens,
                "n_answer": len(answer_ids),
                "unit_chars": [u.end - u.start for u in du.units],
            }
        )
        answer_scores.append(per_unit[0].astype(np.float32))
        question_scores.append(per_unit[1].astype(np.float32))
        print(
            json.dumps({k: records[-1][k] for k in ("index", "answer", "right", "n_units", "gold")})
            + f" {time.perf_counter() - t0:.1f}s",
            file=sys.stderr,
            flush=True,
        )
    arrays = {f"answer_{r['index']}": a for r, a in zip(records, answer_scores)}
    arrays.update({f"question_{r['index']}": q for r, q in zip(records, question_scores)})
    np.savez_compressed(args.out, records=json.dumps(records), **arrays)


# --------------------------------------------------------------------------- analysis


def hits(score: np.ndarray, gold: list[int], k: int) -> bool:
    top = np.argsort(-score, kind="stable")[:k]
    return bool(set(top.tolist()) & set(gold))


def normalised(a: np.ndarray) -> np.ndarray:
    """Each (layer, head)'s unit scores as shares of its document mass."""
    return a / np.maximum(a.sum(-1, keepdims=True), 1e-12)


def learn(data: list[tuple[np.ndarray, list[int]]], steps: int = 300, l2: float = 1e-3) -> np.ndarray:
    """Non-negative per-(layer, head) weights w maximising the log share of the gold units in
    softmax(sum_h w_h a_h(u) * 50) over each instance's units. a_h: the head's attention mass per
    unit, over the whole answer, as kvcli's CitingHeads sums it (no per-head normalisation, which
    a decoding step could not apply), each instance scaled by its largest unit mass of all heads."""
    shape = data[0][0].shape[:2]
    raw = torch.zeros(shape, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([raw], lr=0.05)
    xs = [
        (
            torch.from_numpy(a.astype(np.float64) / max(float(a.sum(axis=(0, 1)).max()), 1e-12) * shape[0] * shape[1]),
            torch.tensor(g),
        )
        for a, g in data
        if g
    ]
    for _ in range(steps):
        opt.zero_grad()
        w = torch.nn.functional.softplus(raw)
        loss = sum(
            -torch.logsumexp(torch.log_softmax(torch.einsum("lh,lhu->u", w, x) * 50, 0)[g], 0) for x, g in xs
        ) / len(xs)
        (loss + l2 * (w**2).sum()).backward()
        opt.step()
    return torch.nn.functional.softplus(raw).detach().numpy()


def analyze(args) -> None:
    z = np.load(args.file)
    records = json.loads(str(z["records"]))
    train = set(span(args.train)) if args.train else set()
    rows = []
    for r in records:
        rows.append((r, z[f"{args.signal}_{r['index']}"].astype(np.float64)))
    n_layers, n_heads = rows[0][1].shape[:2]
    test = [(r, a) for r, a in rows if r["index"] not in train]
    print(
        f"{len(rows)} instances ({len(test)} held out), {n_layers} layers x {n_heads} heads, signal {args.signal}; "
        f"model right on {sum(r['right'] for r, _ in rows)}"
    )
    chance = np.mean([len(r["gold"]) / r["n_units"] for r, _ in test])
    print(f"chance hit@1 (gold units / units): {chance:.3f}")
    per_layer = [
        [np.mean([hits(normalised(a)[layer].sum(0), r["gold"], k) for r, a in test]) for layer in range(n_layers)]
        for k in (1, 3)
    ]
    print(
        "per layer (heads' shares summed) hit@1: "
        + " ".join(f"{layer}:{v:.2f}" for layer, v in enumerate(per_layer[0]))
    )
    print(
        "per layer hit@3:                          "
        + " ".join(f"{layer}:{v:.2f}" for layer, v in enumerate(per_layer[1]))
    )
    everything = [np.mean([hits(a.sum((0, 1)), r["gold"], k) for r, a in test]) for k in (1, 3)]
    print(
        f"all heads averaged (kvcli's sum of every head's weights): hit@1 {everything[0]:.3f}, "
        f"hit@3 {everything[1]:.3f}"
    )
    head = np.array(
        [
            [
                np.mean([hits(a[layer, h], r["gold"], 1) for r, a in rows if r["index"] in train] or [0])
                for h in range(n_heads)
            ]
            for layer in range(n_layers)
        ]
    )
    best = np.dstack(np.unravel_index(np.argsort(-head, axis=None)[:10], head.shape))[0]
    print("best single heads on train (hit@1): " + ", ".join(f"L{layer}H{h} {head[layer, h]:.2f}" for layer, h in best))
    if train:
        w = learn([(a, r["gold"]) for r, a in rows if r["index"] in train])
        scored = [(r, np.einsum("lh,lhu->u", w, a)) for r, a in test]
        learned = [np.mean([hits(s, r["gold"], k) for r, s in scored]) for k in (1, 3)]
        print(f"learned per-head weights (train {len(train)}): held-out hit@1 {learned[0]:.3f}, hit@3 {learned[1]:.3f}")
        top = np.dstack(np.unravel_index(np.argsort(-w, axis=None)[:12], w.shape))[0]
        print("largest weights: " + ", ".join(f"L{layer}H{h} {w[layer, h]:.2f}" for layer, h in top))
        if args.weights_out:
            np.save(args.weights_out, w.astype(np.float32))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--task", default="qa_2")
    c.add_argument("--length", type=int, default=4096)
    c.add_argument("--instances", default="0-59")
    c.add_argument("--quant", default="auto", help="the weights: auto, none, 8 or 4 (as kvcli --quant)")
    c.add_argument("--out", type=Path, required=True)
    a = sub.add_parser("analyze")
    a.add_argument("file", type=Path)
    a.add_argument("--signal", choices=("answer", "question"), default="answer")
    a.add_argument("--train", default=None)
    a.add_argument("--weights-out", type=Path, default=None)
    args = p.parse_args()
    collect(args) if args.cmd == "collect" else analyze(args)


if __name__ == "__main__":
    main()
