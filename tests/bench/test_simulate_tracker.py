"""The simulator's counters on known sequences of ops: live bytes and peak (as the CUDA allocator
books them), host syncs, host->device copies, phases, and the SDPA backend CUDA would choose."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvcli.bench.simulate.sdpa import CudaSdpa, choose
from kvcli.bench.simulate.tracker import Tracker, cuda_block, phase


def test_cuda_block_rounding():
    assert [cuda_block(n) for n in (0, 1, 512, 513, 4096)] == [0, 512, 512, 1024, 4096]


def test_live_bytes_peak_and_allocations_of_a_known_sequence():
    with Tracker("meta") as t:
        a = torch.empty(250, device="meta")  # 1000 bytes -> 1024 booked
        b = torch.empty(1024, device="meta")  # 4096
        view = a[10:20]  # a view: no allocation
        del a  # the view keeps a's storage alive
        assert t.live["meta"] == 1024 + 4096
        del view  # now it is freed
        assert (t.live["meta"], t.peak["meta"]) == (4096, 1024 + 4096)
        c = torch.empty(25, device="meta")  # 100 bytes -> 512
        d = b * 2  # a new 4096
    assert [x.nbytes for x in t.allocations] == [1000, 4096, 100, 4096]
    assert t.live["meta"] == t.peak["meta"] == 4096 + 512 + 4096  # b, c, d
    del b, c, d
    assert t.live["meta"] == 0


def test_peak_is_the_highest_point_not_the_sum():
    with Tracker("meta") as t:
        for _ in range(5):
            x = torch.empty(2048, device="meta")  # 8 KiB, freed by the next iteration's assignment
            del x
        y = torch.empty(4096, device="meta")
    assert t.peak["meta"] == 16384 and len(t.allocations) == 6
    del y


def test_weights_adopted_count_in_the_peak_not_in_the_allocations():
    w = torch.empty(1000, device="meta")
    t = Tracker("meta")
    assert t.adopt([w]) == 4096  # 4000 -> 4096
    with t:
        x = w + 1
    assert t.allocations[0].nbytes == 4000 and len(t.allocations) == 1
    assert t.peak["meta"] == 8192
    del x


def test_syncs_are_counted_and_answered_on_meta():
    t = Tracker("meta", fixed_value=7)
    with torch.inference_mode(), t:
        logits = torch.empty(10, device="meta")
        token = int(torch.argmax(logits))  # one sync, answered 7
        flag = bool(logits[0] > 0)  # one sync, answered False
        ids = torch.empty(3, dtype=torch.long, device="meta").tolist()  # a device->host copy: one sync
        x = logits * 2  # no sync
    assert (token, flag, ids) == (7, False, [0, 0, 0])
    assert t.phases["setup"].syncs == 3 and t.phases["setup"].d2h == 1
    del x


def test_data_dependent_shapes_are_syncs_and_raise_on_meta():
    t = Tracker("meta")
    with t, pytest.raises(NotImplementedError):
        torch.nonzero(torch.empty(4, device="meta"))
    assert t.phases["setup"].syncs == 1


def test_host_to_device_copies_explicit_and_implicit():
    t = Tracker("meta")
    with t, phase(t, "decode:0"):
        pos = torch.arange(4).to("meta")  # explicit copy
        base = torch.empty(8, 2, device="meta")
        picked = base[torch.tensor([1, 3])]  # CPU indices into a device op: implicit copy
        same = torch.arange(3) + 1  # on the CPU: nothing
        scaled = base * 3  # on the device: nothing
    counts = t.phases["decode:0"]
    assert counts.h2d == 2 and counts.syncs == 0
    assert t.counts("decode").h2d == 2 and t.counts("prefill").h2d == 0
    assert any("h2d" in a.op for a in t.allocations)
    del pos, picked, same, scaled


def test_a_cpu_run_has_no_transfers():
    t = Tracker("cpu")
    with t:
        x = torch.arange(4).to("cpu")
        y = torch.ones(3)[torch.tensor([0, 2])]
        v = int(y.sum())
    assert t.phases["setup"].h2d == 0 and t.phases["setup"].syncs == 0 and v == 2
    del x


@pytest.mark.parametrize(
    "q_heads,kv_heads,q_len,kv_len,dtype,mask,causal,expected",
    [
        (8, 2, 16, 16, torch.bfloat16, False, True, "flash"),  # GQA, square causal
        (8, 2, 1, 16, torch.bfloat16, False, False, "flash"),  # decoding
        (8, 2, 4, 16, torch.bfloat16, True, False, "math"),  # a mask and GQA: efficient cannot (before 2026)
        (8, 8, 4, 16, torch.bfloat16, True, False, "efficient"),  # a mask, no GQA
        (8, 8, 4, 16, torch.bfloat16, False, True, "efficient"),  # causal, non-square: not flash
        (8, 8, 16, 16, torch.float32, False, True, "efficient"),  # fp32: no flash
    ],
)
def test_sdpa_backend_choice(q_heads, kv_heads, q_len, kv_len, dtype, mask, causal, expected):
    q = torch.empty(1, q_heads, q_len, 64, dtype=dtype, device="meta")
    k = torch.empty(1, kv_heads, kv_len, 64, dtype=dtype, device="meta")
    m = torch.ones(q_len, kv_len, dtype=torch.bool, device="meta") if mask else None
    assert choose(q, k, k, m, causal, kv_heads != q_heads) == expected


def test_sdpa_math_fallback_allocates_the_score_matrix_and_flash_does_not():
    q = torch.empty(1, 8, 256, 64, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 2, 256, 64, dtype=torch.bfloat16, device="meta")
    mask = torch.ones(256, 256, dtype=torch.bool, device="meta").tril()
    scores = 8 * 256 * 256 * 4  # (heads, q, k) in float32
    sizes = {}
    for name, kwargs in (("flash", dict(is_causal=True)), ("math", dict(attn_mask=mask))):
        t = Tracker("meta")
        with CudaSdpa(tracker=t) as mode, t:
            out = F.scaled_dot_product_attention(q, k, k, enable_gqa=True, **kwargs)
        assert out.shape == q.shape and list(mode.calls) == [("setup", name)]
        sizes[name] = [a.nbytes for a in t.allocations]
    assert scores in sizes["math"] and max(sizes["flash"]) < scores


def test_cpu_and_device_tensors_in_one_op_follow_cudas_rule():
    t = Tracker("meta")
    dev = torch.zeros(4, device="meta", dtype=torch.float64)
    with t:
        ok = dev + torch.tensor(2.0, dtype=torch.float64)  # a 0-dim CPU tensor is a scalar
        with pytest.raises(RuntimeError, match="same device"):
            torch.zeros(4, dtype=torch.float64).add_(dev)  # meta lets this through; CUDA does not
        with pytest.raises(RuntimeError, match="same device"):
            dev.index_select(0, torch.tensor([1, 2]))  # only advanced indexing moves CPU indices
    assert t.phases["setup"].h2d == 0
    del ok


@pytest.mark.parametrize(
    "op",
    [
        lambda d, c: torch.bmm(d, c),  # a matrix product: no CPU operand, whatever its size
        lambda d, c: torch.matmul(d, c),
        lambda d, c: torch.cat([d, c]),
        lambda d, c: torch.stack([d, c]),
        lambda d, c: torch.cat([d, c.sum().expand(1, 3, 3)]),  # an expanded 0-dim: still a CPU tensor
        lambda d, c: F.embedding(torch.tensor([0, 1]), d[0]),  # a CPU index into a device table
        lambda d, c: d[0].gather(0, torch.zeros(3, 3, dtype=torch.long)),
        lambda d, c: d[0].index_add(0, torch.tensor([0]), c[0][:1]),
        lambda d, c: F.scaled_dot_product_attention(d[None], d[None], d[None], attn_mask=torch.ones(3, 3).bool()),
        lambda d, c: F.embedding(torch.tensor(1), d[0]),  # a 0-dim CPU index is no scalar to an embedding
        lambda d, c: torch.cat([d.flatten(), torch.tensor([2.0])]),
    ],
)
def test_every_op_but_elementwise_scalars_and_indices_refuses_a_cpu_tensor(op):
    """CUDA's rule on every op, as PyTorch's CUDA kernels apply it (meta alone checks none of it)."""
    dev, cpu = torch.zeros(1, 3, 3, device="meta"), torch.zeros(1, 3, 3)
    with Tracker("meta"), pytest.raises(RuntimeError, match="same device"):
        op(dev, cpu)


def test_what_cuda_accepts_from_the_cpu_passes():
    t = Tracker("meta")
    dev = torch.zeros(4, 3, device="meta")
    with t:
        kept = [
            dev * torch.tensor(2.0),  # an elementwise op reads a 0-dim CPU tensor as a scalar
            torch.where(dev > 0, dev, torch.tensor(0.0)),
            dev[torch.tensor([0, 2])],  # CPU indices: copied over
        ]
        dev[torch.tensor([1])] = torch.tensor(5.0)  # a 0-dim value put with CPU indices
        with pytest.raises(RuntimeError, match="same device"):
            dev[torch.tensor([1])] = torch.ones(1, 3)  # values of more than one element: on the device
    assert t.phases["setup"].h2d == 2
    del kept


def test_ops_are_counted_per_phase_and_capped():
    t = Tracker("meta", max_ops=5)
    x = torch.empty(4, device="meta")
    with t:
        with phase(t, "decode:0"):
            y = (x + 1) * 2  # two ops
        with pytest.raises(RuntimeError, match="over 5 ATen ops"):
            for _ in range(10):
                y = y + 1
    assert t.phases["decode:0"].ops == 2 and t.ops == 6
