"""kvcli.attribution: the answer's attention per prompt position, against an explicit computation
(every query head against its KV head's keys, written out one at a time)."""

from __future__ import annotations

import math

import torch

from kvcli.attribution import CitingHeads, HeadWeights, step_weights


def explicit(query, key, head):
    """Head ``head``'s softmax weights over the keys, the GQA group read by hand."""
    n_heads, n_kv = query.shape[1], key.shape[1]
    k = key[0, head // (n_heads // n_kv)]
    logits = [float(query[0, head, -1] @ k[r]) / math.sqrt(query.shape[-1]) for r in range(k.shape[0])]
    top = max(logits)
    e = [math.exp(x - top) for x in logits]
    return [x / sum(e) for x in e]


def test_step_weights_are_each_query_heads_softmax_over_its_kv_heads_keys():
    g = torch.Generator().manual_seed(0)
    query, key = torch.randn(1, 6, 1, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g)
    got = step_weights(query, key)
    assert got.shape == (2, 3, 5)
    for head in range(6):
        assert torch.allclose(got[head // 3, head % 3], torch.tensor(explicit(query, key, head)), atol=1e-6)


class FakeCache:
    def __init__(self, rows):
        self.rows = rows

    def held_positions(self, layer):
        return self.rows[layer]


def test_citing_heads_add_weighted_heads_to_the_positions_rows_hold():
    g = torch.Generator().manual_seed(1)
    n_heads, n_kv, d = 4, 2, 8
    weights = torch.zeros(3, n_heads)
    weights[1] = torch.tensor([0.5, 0.0, 2.0, 1.0])
    # layer 1 holds prompt positions per KV head (an eviction), then one answer row
    held = torch.tensor([[0, 2, 5], [1, 2, 6]])
    reader = CitingHeads(HeadWeights(weights, "test"), n_prompt=7, cache=FakeCache({1: held}))
    observers = reader.observers()
    assert list(observers) == [1]
    query, key = torch.randn(1, n_heads, 1, d, generator=g), torch.randn(1, n_kv, 4, d, generator=g)
    observers[1][0](torch.randn(1, n_heads, 3, d), key)  # a prompt pass: ignored
    observers[1][0](query, key)
    want = [0.0] * 7
    for head in range(n_heads):
        probs = explicit(query, key, head)
        for row, pos in enumerate(held[head // 2].tolist()):
            want[pos] += float(weights[1, head]) * probs[row]  # the answer row (3) is no prompt token
    assert torch.allclose(reader.scores, torch.tensor(want, dtype=torch.float64), atol=1e-6)
    assert reader.steps == 1
    scores = reader.token_scores(torch.tensor([True] * 6 + [False]))
    assert math.isnan(scores[6]) and scores[5] == reader.scores[5]
