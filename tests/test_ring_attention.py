"""Ring attention (ops/ring.py) on 2 and 4 CPU ranks against dense causal attention of the whole sequence, float64.

Masks too (padding keys, packed documents and a sliding window through the queries' lower bounds, a softcap,
attention sinks), each against dense attention with the same mask.

Each rank holds its zigzag shard (different tokens on every rank); the output, dQ, dK and dV of every rank, glued
back into the whole sequence, must equal plain autograd through a dense causal softmax attention to 1e-10 (float64:
the only differences are summation orders). Mutation controls, each of which must break that agreement: a ring step
skipped, the merge without its log-sum-exp or in bf16, the ranks disagreeing on the zigzag order, dK/dV not sent
home after the last step. The call-order test checks that each step's K/V transfer is posted before its tiles run.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed

B, T_PER_RANK, D, DV = 2, 8, 8, 6  # DV != D: values of another head dim (multi-head latent attention)


def _data(size: int, heads: int, kv_heads: int):
    g = torch.Generator().manual_seed(1234 + size)
    T = T_PER_RANK * size
    q = torch.randn(B, heads, T, D, dtype=torch.float64, generator=g)
    k = torch.randn(B, kv_heads, T, D, dtype=torch.float64, generator=g)
    v = torch.randn(B, kv_heads, T, DV, dtype=torch.float64, generator=g)
    do = torch.randn(B, heads, T, DV, dtype=torch.float64, generator=g)
    return q, k, v, do


def _dense(q, k, v, do):
    """(out, dq, dk, dv) of dense causal attention, plain autograd."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    R = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(R, 1), v.repeat_interleave(R, 1)
    scores = q @ kr.transpose(-1, -2) * D ** -0.5
    T = q.shape[2]
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    out = scores.softmax(-1) @ vr
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def _ring(rank: int, size: int, heads: int, kv_heads: int, kernel: str, blocks=None):
    """This rank's (out, dq, dk, dv) from ring_attention on its zigzag shards (``blocks``: the layout the test
    shards with, default the op's own)."""
    import torch.distributed as dist

    from ds_longseq.ops import ring

    q, k, v, do = _data(size, heads, kv_heads)
    blocks = blocks or ring.zigzag_blocks

    def shard(t):
        parts = t.chunk(2 * size, dim=2)
        return torch.cat([parts[i] for i in blocks(rank, size)], dim=2).clone().requires_grad_()

    ql, kl, vl = shard(q), shard(k), shard(v)
    out = ring.ring_attention(ql, kl, vl, dist.group.WORLD, kernel=kernel)
    out.backward(shard(do).detach())
    return out.detach(), ql.grad, kl.grad, vl.grad


def _glue(per_rank: list):
    from ds_longseq.ops.ring import zigzag_unshard

    return [zigzag_unshard([r[i] for r in per_rank], dim=2) for i in range(4)]


def _errors(size: int, heads: int, kv_heads: int, per_rank: list) -> list[float]:
    want = _dense(*_data(size, heads, kv_heads))
    return [(a - b).abs().max().item() for a, b in zip(_glue(per_rank), want, strict=True)]


def exact_body(rank: int, size: int, heads: int, kv_heads: int, kernel: str):
    from ds_longseq.ops import ring

    events = []
    post, block = ring._post_exchange, ring._block_forward

    def logged_post(tensors, *args):
        events.append(("post", len(events)))
        return post(tensors, *args)

    def logged_block(*args):
        events.append(("tile", len(events)))
        return block(*args)

    ring._post_exchange, ring._block_forward = logged_post, logged_block
    try:
        result = _ring(rank, size, heads, kv_heads, kernel)
    finally:
        ring._post_exchange, ring._block_forward = post, block
    return result, [e[0] for e in events]


@pytest.mark.parametrize("size, heads, kv_heads, kernel", [(2, 4, 2, "auto"), (4, 4, 4, "math"), (4, 6, 2, "auto")])
def test_ring_attention_equals_dense_attention(size, heads, kv_heads, kernel):
    results = run_distributed(exact_body, size, (size, heads, kv_heads, kernel), timeout=300)
    errors = _errors(size, heads, kv_heads, [r[0] for r in results])
    assert max(errors) < 1e-10, errors  # float64: only summation orders differ
    # the forward's K/V transfer for step s + 1 is posted before step s's tiles run ("P"), then the tiles ("T"):
    # three at step 0 (two causal diagonals, one full tile), two full tiles at every later step (the zigzag balance)
    expected = "P" + "TTT" + "PTT" * (size - 2) + "TT"
    for _, events in results:
        trace = "".join("P" if e == "post" else "T" for e in events)
        assert trace[: trace.rindex("T") + 1] == expected, trace


def _masked_case(size: int, heads: int, case: str):
    """(key_valid (B, T), query_lo (B, T), softcap, sinks (H,)) of one masked case, the whole sequence's."""
    from ds_longseq.ops.chunk_attention import query_lower_bounds

    T = T_PER_RANK * size
    g = torch.Generator().manual_seed(99)
    key_valid = query_lo = softcap = sinks = None
    if case in ("padding", "everything"):
        key_valid = torch.ones(B, T, dtype=torch.bool)
        key_valid[0, :5] = False  # row 0 left-padded: its first queries see no valid key at all
        key_valid[1, T - 3:] = False  # row 1 right-padded
    if case in ("documents", "everything"):
        doc_start = torch.zeros(B, T, dtype=torch.int64)
        for row, starts in enumerate(([0, 3, T // 2 + 1], [0, T - 2])):
            for a in starts:
                doc_start[row, a:] = a
        window = 5 if case == "everything" else None
        query_lo = query_lower_bounds(torch.arange(T), doc_start, window)
    if case in ("softcap", "everything"):
        softcap = 2.5
    if case in ("sinks", "everything"):
        sinks = torch.randn(heads, dtype=torch.float64, generator=g)
    return key_valid, query_lo, softcap, sinks


def _dense_masked(q, k, v, do, key_valid, query_lo, softcap, sinks):
    """Dense causal attention with the same masks, plain autograd; a row that sees no key gives 0."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    sinks = None if sinks is None else sinks.clone().requires_grad_()
    R = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(R, 1), v.repeat_interleave(R, 1)
    T = q.shape[2]
    scores = q @ kr.transpose(-1, -2) * D ** -0.5
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    keep = ~torch.ones(T, T, dtype=torch.bool).triu(1).view(1, 1, T, T)
    if key_valid is not None:
        keep = keep & key_valid.view(B, 1, 1, T)
    if query_lo is not None:
        keep = keep & (torch.arange(T).view(1, 1, 1, T) >= query_lo.view(query_lo.shape[0], 1, T, 1))
    empty = ~keep.any(-1, keepdim=True)
    scores = scores.masked_fill(~keep, float("-inf")).masked_fill(empty, 0.0)
    if sinks is not None:  # one more logit per head with a zero value; a row with no key puts all its mass there
        scores = torch.cat([scores.masked_fill(empty, float("-inf")), sinks.view(1, -1, 1, 1).expand(B, -1, T, 1)], -1)
        p = scores.softmax(-1)[..., :-1]
    else:
        p = scores.softmax(-1).masked_fill(empty, 0.0)
    out = p @ vr
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad, None if sinks is None else sinks.grad


def masked_body(rank: int, size: int, heads: int, kv_heads: int, case: str):
    import torch.distributed as dist

    from ds_longseq.ops import ring

    q, k, v, do = _data(size, heads, kv_heads)
    key_valid, query_lo, softcap, sinks = _masked_case(size, heads, case)

    def shard(t):
        return ring.zigzag_shard(t, rank, size, dim=2).clone().requires_grad_()

    ql, kl, vl = shard(q), shard(k), shard(v)
    lo = None if query_lo is None else ring.zigzag_shard(query_lo, rank, size, dim=1)
    sinks = None if sinks is None else sinks.clone().requires_grad_()
    out = ring.ring_attention(ql, kl, vl, dist.group.WORLD, key_valid=key_valid, query_lo=lo, softcap=softcap,
                              sink_logits=sinks)
    out.backward(shard(do).detach())
    return out.detach(), ql.grad, kl.grad, vl.grad, None if sinks is None else sinks.grad


@pytest.mark.parametrize("size, case", [(2, "padding"), (2, "documents"), (2, "softcap"), (2, "sinks"),
                                        (4, "everything")])
def test_ring_attention_with_masks_equals_dense_attention(size, case):
    """Padding keys (a row whose first queries see none), packed documents and a sliding window (key blocks no
    query sees are skipped), a softcap and attention sinks, each against dense attention with the same masks."""
    heads, kv_heads = 4, 2
    per_rank = run_distributed(masked_body, size, (size, heads, kv_heads, case), timeout=300)
    want = _dense_masked(*_data(size, heads, kv_heads), *_masked_case(size, heads, case))
    got = _glue([r[:4] for r in per_rank])
    errors = [(a - b).abs().max().item() for a, b in zip(got, want[:4], strict=True)]
    if want[4] is not None:  # each rank's sink gradient is its queries' share: summed over the ring
        errors.append((sum(r[4] for r in per_rank) - want[4]).abs().max().item())
    assert max(errors) < 1e-10, errors


def mutation_body(rank: int, size: int):
    from ds_longseq.ops import ring

    original = {name: getattr(ring, name) for name in ("_ring_steps", "_merge", "zigzag_blocks", "_pass_gradients")}
    true_blocks = ring.zigzag_blocks

    def merge_without_lse(acc, m, o, lse):
        return (o, lse) if acc is None else ((acc + o) / 2, torch.logaddexp(m, lse))

    def merge_in_bf16(acc, m, o, lse):
        cast = [None if t is None else t.to(torch.bfloat16) for t in (acc, m, o, lse)]
        acc, m = original["_merge"](*cast)
        return acc.to(o.dtype), m.to(o.dtype)

    def home_skipped(dkv, group, r, s, step):
        return dkv if step == s - 1 else original["_pass_gradients"](dkv, group, r, s, step)

    mutations = {
        "step skipped": ("_ring_steps", lambda s: range(s - 1)),
        "merge without log-sum-exp": ("_merge", merge_without_lse),
        "merge in bf16": ("_merge", merge_in_bf16),
        "zigzag order swapped in the op": ("zigzag_blocks", lambda r, s: true_blocks(r, s)[::-1]),
        "dK/dV not sent home": ("_pass_gradients", home_skipped),
    }
    results = {"none": _ring(rank, size, 4, 2, "auto")}
    for what, (name, fn) in mutations.items():
        setattr(ring, name, fn)
        try:
            results[what] = _ring(rank, size, 4, 2, "auto", blocks=true_blocks)
        finally:
            setattr(ring, name, original[name])
    return results


def test_each_mutation_breaks_exactness():
    size = 4
    per_rank = run_distributed(mutation_body, size, (size,), timeout=300)
    assert max(_errors(size, 4, 2, [r["none"] for r in per_rank])) < 1e-10
    for what in per_rank[0]:
        if what != "none":
            errors = _errors(size, 4, 2, [r[what] for r in per_rank])
            assert max(errors) > 1e-3, (what, errors)


# bitwise by construction: integers
def test_zigzag_shards_glue_back_and_balance_the_causal_work():
    from ds_longseq.ops.ring import _tile_kind, zigzag_blocks, zigzag_shard, zigzag_unshard

    x = torch.arange(2 * 16).reshape(2, 16)
    shards = [zigzag_shard(x, r, 4) for r in range(4)]
    assert shards[0].tolist()[0] == [0, 1, 14, 15] and shards[3].tolist()[0] == [6, 7, 8, 9]
    assert torch.equal(zigzag_unshard(shards), x)
    with pytest.raises(ValueError, match="not a multiple of 2 x 3 ring ranks"):
        zigzag_shard(x, 0, 3)
    size = 4
    for rank in range(size):  # every rank runs the same number of tiles over the ring (causal ones count half)
        work = 0.0
        for step in range(size):
            theirs = zigzag_blocks((rank - step) % size, size)
            for a in zigzag_blocks(rank, size):
                for b in theirs:
                    kind = _tile_kind(a, b)
                    work += {"full": 1.0, "causal": 0.5, None: 0.0}[kind]
        assert work == 2 * size, (rank, work)


def two_d_body(rank: int, ulysses: int, ring_size: int):
    """This rank's (positions, out, dq, dk, dv, d_sinks) under Ulysses x ring (u x r) with every mask at once, on the
    groups ops.sp_layout.SPLayout.build makes."""
    import torch.distributed as dist

    from ds_longseq.ops.chunk_attention import KeyLimits
    from ds_longseq.ops.sp_layout import SPLayout
    from ds_longseq.ops.sp_positions import sp_positions
    from ds_longseq.ops.ulysses import UlyssesExchange, ulysses_ring_attention

    size, heads, kv_heads = ulysses * ring_size, 4, 2
    layout = SPLayout.build(dist.group.WORLD, size, ring_size)
    u_group = layout.ulysses_group
    if ring_size == 1:  # Ulysses alone: the attention's ring is each rank on its own (every rank makes each one)
        r_group = [dist.new_group([r]) for r in range(size)][rank]
    else:
        r_group = layout.ring_group
    j, i = divmod(rank, ulysses)
    assert dist.get_process_group_ranks(u_group) == list(range(j * ulysses, (j + 1) * ulysses))
    assert dist.get_process_group_ranks(r_group) == list(range(i, size, ulysses))
    exchange = UlyssesExchange(u_group, ulysses, heads, kv_heads) if ulysses > 1 else None
    q, k, v, do = _data(size, heads, kv_heads)
    key_valid, doc_start, window, softcap, sinks = _two_d_case(size, heads)
    pos = sp_positions(q.shape[2], ulysses, ring_size)[rank]
    ql, kl, vl = (t[:, :, pos].clone().requires_grad_() for t in (q, k, v))
    sinks = sinks.clone().requires_grad_()
    out = ulysses_ring_attention(ql, kl, vl, exchange, r_group, scale=D ** -0.5, key_valid=key_valid,
                                 limits=KeyLimits(doc_start, window), softcap=softcap, sink_logits=sinks)
    out.backward(do[:, :, pos])
    return pos, out.detach(), ql.grad, kl.grad, vl.grad, sinks.grad


def _two_d_case(size: int, heads: int):
    """(key_valid, doc_start, window, softcap, sinks) of the whole sequence: every mask at once."""
    T = T_PER_RANK * size
    key_valid = torch.ones(B, T, dtype=torch.bool)
    key_valid[0, :5] = False
    key_valid[1, T - 3:] = False
    doc_start = torch.zeros(B, T, dtype=torch.int64)
    for row, starts in enumerate(([0, 3, T // 2 + 1], [0, T - 2])):
        for a in starts:
            doc_start[row, a:] = a
    sinks = torch.randn(heads, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    return key_valid, doc_start, 5, 2.5, sinks


@pytest.mark.parametrize("ulysses, ring_size", [  # CI time: 4 ranks each; pure rings of 4 run in the tests above
    (2, 2), pytest.param(1, 4, marks=pytest.mark.slow), pytest.param(4, 1, marks=pytest.mark.slow)])
def test_ulysses_x_ring_equals_dense_attention(ulysses, ring_size):
    """4 CPU ranks as 2 x 2, 1 x 4 (ring alone) and 4 x 1 (Ulysses alone, 2 key/value heads repeated): each rank's
    tokens from ops.sp_layout, padding, packed documents, a sliding window, a softcap and sinks; the whole
    sequence's output and every gradient against dense attention in float64."""
    from ds_longseq.ops.chunk_attention import query_lower_bounds

    size, heads, kv_heads = ulysses * ring_size, 4, 2
    per_rank = run_distributed(two_d_body, size, (ulysses, ring_size), timeout=300)
    q, k, v, do = _data(size, heads, kv_heads)
    key_valid, doc_start, window, softcap, sinks = _two_d_case(size, heads)
    query_lo = query_lower_bounds(torch.arange(q.shape[2]), doc_start, window)
    want = _dense_masked(q, k, v, do, key_valid, query_lo, softcap, sinks)
    got = [torch.zeros_like(w) for w in want[:4]]
    for pos, *tensors in per_rank:
        for g, t in zip(got, tensors[:4], strict=True):
            g[:, :, pos] = t
    errors = [(a - b).abs().max().item() for a, b in zip(got, want[:4], strict=True)]
    errors.append((sum(r[5] for r in per_rank) - want[4]).abs().max().item())
    assert max(errors) < 1e-10, errors


def groups_body(rank: int):
    import torch.distributed as dist

    from ds_longseq.ops.sp_layout import SPLayout

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # DeepSpeed's SP groups of 2 (every rank makes both)
    out = {}
    for size, ulysses in ((4, 2), (2, 1), (2, 2), (4, 4)):
        group = dist.group.WORLD if size == 4 else pairs[rank // 2]
        layout = SPLayout.build(group, size, size // ulysses)
        assert layout.group is group and layout.degrees == (ulysses, size // ulysses) and layout.rank == rank % size
        out[(size, ulysses)] = tuple(None if g is None else dist.get_process_group_ranks(g)
                                     for g in (layout.ulysses_group, layout.ring_group))
    try:  # under a ring the groups must be DeepSpeed's: runs of consecutive ranks
        SPLayout.build([dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2], 2, 2)
    except ValueError as err:
        out["refused"] = str(err)
    return out


def test_sp_layout_builds_the_groups_of_each_sequence_parallel_group():
    """On 4 ranks: one SP group of 4 as 2 x 2 (Ulysses {0,1} {2,3}, rings {0,2} {1,3}) or 4 x 1 (Ulysses alone: the
    group itself, no ring group); two SP groups of 2 (ranks 0-1 and 2-3, DeepSpeed's) as ring alone or Ulysses alone;
    a ring over groups of ranks that are not consecutive is refused."""
    per_rank = run_distributed(groups_body, 4, (), timeout=300)
    want = {
        (4, 2): [([0, 1], [0, 2]), ([0, 1], [1, 3]), ([2, 3], [0, 2]), ([2, 3], [1, 3])],
        (2, 1): [([0], [0, 1]), ([1], [0, 1]), ([2], [2, 3]), ([3], [2, 3])],
        (2, 2): [([0, 1], None), ([0, 1], None), ([2, 3], None), ([2, 3], None)],
        (4, 4): [([0, 1, 2, 3], None)] * 4,
    }
    for key, groups in want.items():
        assert [r[key] for r in per_rank] == groups, key
    assert all("needs DeepSpeed's sequence-parallel groups" in r["refused"] for r in per_rank)
