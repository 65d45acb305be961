"""Head-parallel CP (``kv_exchange="ulysses"``, ``blockdiag_cp/ulysses.py``) on gloo at cp 2, 3 and 4.

In float64 against the single-process reference: every layout (thd from padded ids), the
document cases of ``cases.py``, GQA with the K/V heads split (Hkv % cp == 0) and repeated
(Hkv < cp or not a multiple), MLA head dims, sliding windows, learnable sinks (their
gradient summed over the group, as Megatron reduces it), dropout (directional derivative and
replayed masks, shared with test_engine_dist). Also: the bytes each rank moves, which are
the two all-to-alls and nothing else, and the refusal of a cp that does not divide the query
heads, raised alike on every rank.
"""

import math

import pytest
import torch

from megatron_ext.testing import WorkerPool, catch, pool_per_cp_fixture, reference_attention
from megatron_ext.testing.cases import CASES, make_doc_ids
from test_engine_dist import dropout_checks
from test_variants import _thd_padded

LAYOUTS = ("contiguous", "zigzag", "balanced", "thd")
TOL = 1e-12
# (Hq, Hkv, Dqk, Dv): at cp 2 / 3 / 4 the 2 K/V heads split / repeat 3x / split; the 6 split / split
# / repeat 2x; MLA's value dim differs.
HEADS = [(12, 2, 8, 8), (12, 6, 8, 4)]


def _rel(a, b):
    return float((a.detach() - b).abs().max() / b.abs().max().clamp_min(1e-12))


def errors_against_reference(doc_ids, heads, window, build, seed=29):
    """Float64 q, k, v, a loss weight and a sink of ``heads`` (Hq, Hkv, Dqk, Dv) for ``doc_ids``; the state
    ``build(doc_ids)`` attends this rank's share (sliding ``window``, the sink), backward through the
    weighted sum, the sink's gradient summed over the group: ([errors of out, dq, dk, dv, dsink] against
    ``reference_attention``, the state)."""
    import torch.distributed as dist

    import megatron_ext.blockdiag_cp as bdcp

    hq, hkv, dk, dv = heads
    b = doc_ids.shape[0] if doc_ids.dim() == 2 else 1
    n = doc_ids.shape[-1]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, b, hq, dk, generator=g, dtype=torch.float64)
    k = torch.randn(n, b, hkv, dk, generator=g, dtype=torch.float64)
    v = torch.randn(n, b, hkv, dv, generator=g, dtype=torch.float64)
    w = torch.randn(n, b, hq, dv, generator=g, dtype=torch.float64)
    sink = torch.randn(hq, generator=g, dtype=torch.float64)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_sink = sink.clone().requires_grad_()
    ref = reference_attention(*ref_in, doc_ids, window=window, sink=ref_sink)
    (ref * w).sum().backward()
    state = build(doc_ids)
    local = [state.shard(t).detach().requires_grad_() for t in (q, k, v)]
    offset = sink.clone().requires_grad_()
    with bdcp.blockdiag_cp_step(state):
        out = bdcp.blockdiag_cp_attention(*local, window_size=None if window is None else (window, 0),
                                          softmax_offset=offset)
        (out * state.shard(w)).sum().backward()
    d_sink = offset.grad.clone()
    dist.all_reduce(d_sink)  # each rank has its heads' (or its queries') share
    errs = [_rel(out, state.shard(ref))] + [_rel(t.grad, state.shard(r.grad)) for t, r in zip(local, ref_in)]
    return errs + [_rel(d_sink, ref_sink.grad)], state


def check_ulysses(case, heads, window, layouts=LAYOUTS, S=96, exchange="ulysses", ulysses_size=None,
                  kv_backward=None):
    """On every rank: {layout: ([errors of out, dq, dk, dv, dsink], bytes sent, bytes received, exchange,
    local length, kv_backward, the report)}."""
    import torch.distributed as dist

    import megatron_ext.blockdiag_cp as bdcp

    cp = dist.get_world_size()
    results = {}
    for layout in layouts:
        doc_ids = make_doc_ids(case, S, cp)
        if layout == "thd":
            if doc_ids.dim() == 2:
                continue  # THD packs one row
            doc_ids = _thd_padded(doc_ids, 2 * cp)
        errs, state = errors_against_reference(doc_ids, heads, window, lambda ids: bdcp.BlockDiagCPState.build(
            ids, layout=layout, kv_exchange=exchange, attn_backend="dense", ulysses_size=ulysses_size,
            kv_backward=kv_backward))
        report = state.report()
        results[layout] = (errs, report["bytes_sent"], report["bytes_received"], report["kv_exchange"],
                           report["local_len"], report["kv_backward"], report)
    return results


def refused_heads():
    import megatron_ext.blockdiag_cp as bdcp

    doc_ids = make_doc_ids("short", 48, 3)
    state = bdcp.BlockDiagCPState.build(doc_ids, kv_exchange="heads", attn_backend="dense")
    q, k, v = (torch.randn(state.local_len, 1, h, 8) for h in (4, 2, 2))
    with bdcp.blockdiag_cp_step(state):
        return catch(lambda: bdcp.blockdiag_cp_attention(q, k, v))


pool = pool_per_cp_fixture([2, 3, 4])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("heads", HEADS, ids=["gqa2", "gqa6_mla"])
def test_matches_reference_every_layout(pool, case, heads):
    results = pool.run(check_ulysses, case, heads, None)
    cp = len(results)
    hq, hkv, dk, dv = heads
    repeats = cp // math.gcd(hkv, cp)
    for rank, per_rank in enumerate(results):
        for layout, (errs, sent, received, exchange, L, kv_backward, _) in per_rank.items():
            assert max(errs) < TOL, (rank, layout, errs)
            assert exchange == "ulysses" and kv_backward == "save", (exchange, kv_backward)
            # The two all-to-alls: q, k, v (k and v after the repeat) in, out back; all but the own block.
            b = 2 if case == "b2" else 1
            moved = L * b * (hq * dk + hkv * repeats * (dk + dv) + hq * dv) * 8 * (cp - 1) // cp
            assert sent == received == moved, (layout, sent, received, moved)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("window", [0, 5, 23])
@pytest.mark.parametrize("case", ["single", "short", "pad_middle", "b2"])
def test_sliding_windows_and_sinks(pool, case, window):
    for rank, per_rank in enumerate(pool.run(check_ulysses, case, HEADS[1], window)):
        for layout, (errs, *_) in per_rank.items():
            assert max(errs) < 1e-10, (rank, layout, window, errs)


@pytest.mark.timeout(300)
def test_dropout_gradients_and_replayed_masks(pool):
    if 4 % pool.world:
        pytest.skip("dropout_checks' 4 query heads do not split over 3 ranks")
    for r in pool.run(dropout_checks, "zigzag", "ulysses", "auto"):
        assert abs(r["analytic"] - r["numeric"]) <= 1e-6 * max(1.0, abs(r["numeric"])), r
        assert r["out"] == r["same_seed"], r  # the same generator state draws the same masks
        assert r["other_seed"] != r["same_seed"] and r["clean"] != r["out"], r


def posts_against_reference(heads, needs_grad, build, seed):
    """zigzag, short documents over this group, float64; ``needs_grad``: which of q, k, v require a
    gradient; the state ``build(doc_ids)``. This rank's (forward, backward) posts, first waits and kernel
    calls as ("post" | "wait", number of the post) and ("kernel", None) (one for calls in a row), the errors
    of out and of the gradients asked for against the reference, and the state."""
    import torch.distributed as dist

    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.testing.op_counter import KernelEvent, OpCounter, PostEvent, WaitEvent

    doc_ids = make_doc_ids("short", 96, dist.get_world_size())
    hq, hkv, dk, dv = heads
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(96, 1, h, d, generator=g, dtype=torch.float64) for h, d in ((hq, dk), (hkv, dk), (hkv, dv)))
    w = torch.randn(96, 1, hq, dv, generator=g, dtype=torch.float64)
    full = [t.clone().requires_grad_(need) for t, need in zip((q, k, v), needs_grad)]
    want = reference_attention(*full, doc_ids)
    (want * w).sum().backward()
    state = build(doc_ids)
    mine = [state.shard(t).detach().requires_grad_(need) for t, need in zip((q, k, v), needs_grad)]
    counter = OpCounter(log=True)
    with bdcp.blockdiag_cp_step(state), counter:
        with counter.region("forward"):
            out = bdcp.blockdiag_cp_attention(*mine)
        with counter.region("backward"):
            (out * state.shard(w)).sum().backward()
    errors = [_rel(out, state.shard(want))] + [_rel(t.grad, state.shard(f.grad))
                                               for t, f in zip(mine, full) if f.requires_grad]

    def entry(e):
        if isinstance(e, PostEvent):
            return ("post", e.post)
        if isinstance(e, WaitEvent):
            return ("wait", e.post)
        return ("kernel", None) if isinstance(e, KernelEvent) else None

    orders = []
    for phase in ("forward", "backward"):
        order = []
        for x in map(entry, counter.counts[phase].events):
            if x is not None and not (x == ("kernel", None) and order and order[-1] == x):
                order.append(x)
        orders.append(order)
    return tuple(orders), errors, state


def pipelined_order(count, kv_whole, needs_grad, first_posts=(1, 1)):
    """The (forward, backward) order ``head_groups`` documents, as ``posts_against_reference`` records it,
    posts numbered from ``first_post`` as they are made: forward posts group 0's moves in (K / V whole
    first), then per group the next group's moves, waits for its own, attends it and posts its output
    home; it waits for the outputs last. Backward likewise with the output's gradient, posting home per
    group the gradients ``needs_grad`` asks for (K / V whole: after the last group). ``first_posts``: the
    number of each phase's first post."""

    def pipeline(first, ins_per_group, before, home_per_group, after):
        posts = iter(range(first, first + 10 ** 6))
        order, moves_in, home = [], {}, []
        ahead = [next(posts) for _ in range(before)]
        order += [("post", n) for n in ahead]
        moves_in[0] = [next(posts) for _ in range(ins_per_group)]
        order += [("post", n) for n in moves_in[0]] + [("wait", n) for n in ahead]
        for g in range(count):
            if g + 1 < count:
                moves_in[g + 1] = [next(posts) for _ in range(ins_per_group)]
                order += [("post", n) for n in moves_in[g + 1]]
            order += [("wait", n) for n in moves_in[g]] + [("kernel", None)]
            mine = [next(posts) for _ in range(home_per_group)]
            order += [("post", n) for n in mine]
            home += mine
        last = [next(posts) for _ in range(after)]
        return order + [("post", n) for n in last] + [("wait", n) for n in home + last]

    need_q, need_k, need_v = needs_grad
    forward = pipeline(first_posts[0], 1 if kv_whole else 3, 2 if kv_whole else 0, 1, 0)
    kv_home = int(need_k) + int(need_v)
    backward = pipeline(first_posts[1], 1, 0, int(need_q) + (0 if kv_whole else kv_home), kv_home if kv_whole else 0)
    return forward, backward


def ulysses_posts(needs_grad):
    """``posts_against_reference`` of the ulysses exchange: (orders, errors, this rank's head groups)."""
    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.blockdiag_cp.head_groups import head_groups_for

    orders, errors, state = posts_against_reference(HEADS[0], needs_grad, lambda ids: bdcp.BlockDiagCPState.build(
        ids, layout="zigzag", kv_exchange="ulysses", attn_backend="dense"), seed=9)
    cp, (hq, hkv) = state.cp, HEADS[0][:2]
    return orders, errors, head_groups_for(hq // cp, hkv * (cp // math.gcd(hkv, cp)) // cp, exchanging=False)


@pytest.mark.timeout(120)
def test_head_groups_are_pipelined_one_ahead(pool):
    """The rank's 6 query heads over one K / V head at cp 2 go in 2 groups, K / V moved whole first: each
    group's q moves while the group before it is attended, its output goes home as soon as attended, and
    backward does the same with the output's gradient and dq, dK and dV home (only those an input needs:
    here every one, or q's alone). The results match the reference."""
    if pool.world != 2:
        pytest.skip("one cp is enough")
    for needs_grad, back in (((True, True, True), 3), ((True, False, False), 1)):
        for (forward, backward), errors, groups in pool.run(ulysses_posts, needs_grad):
            assert max(errors) < TOL and len(errors) == 1 + back, (needs_grad, errors)
            assert (groups.count, groups.kv_whole) == (2, True), groups
            firsts = [min(n for kind, n in order if kind == "post") for order in (forward, backward)]
            want_forward, want_backward = pipelined_order(2, True, needs_grad, firsts)
            assert forward == want_forward, forward
            assert backward == want_backward, backward


@pytest.mark.parametrize("heads, kv_whole_allowed, want", [
    ((6, 1), True, (2, 3, 1, True)),   # fewer K / V heads than groups: moved whole, two groups a head
    ((6, 1), False, (1, 6, 1, False)),  # a ring level (or a re-laid call) exchanges them: one group
    ((8, 8), False, (4, 2, 2, False)),  # K / V split alike, at most MAX_HEAD_GROUPS
    ((32, 8), False, (4, 8, 2, False)),
    ((4, 2), True, (4, 1, 2, True)),
    ((8, 1), True, (2, 4, 1, True)),   # not 4: four groups on one K / V head would sum its gradient in float32
    ((6, 3), True, (3, 2, 1, False)),
    ((5, 5), True, (1, 5, 5, False)),  # 5 does not split into 2 to 4 groups
])
def test_head_groups_split_the_heads_evenly(heads, kv_whole_allowed, want):
    from megatron_ext.blockdiag_cp.head_groups import head_groups

    groups = head_groups(*heads, kv_whole_allowed=kv_whole_allowed)
    assert (groups.count, groups.q_heads, groups.kv_heads, groups.kv_whole) == want, groups
    # every group's query heads sit on the K / V heads it reads (GQA: query head i reads K / V head i // ratio)
    ratio = heads[0] // heads[1]
    for g in range(groups.count):
        kv = groups.kv_of(g)
        assert kv.stop - kv.start == (1 if groups.kv_whole else groups.kv_heads)
        for i in range(g * groups.q_heads, (g + 1) * groups.q_heads):
            assert kv.start <= i // ratio < kv.stop, (g, i, kv)


@pytest.mark.timeout(120)
def test_a_cp_that_does_not_split_the_query_heads_is_refused_on_every_rank():
    with WorkerPool(3) as pool:
        for name, message in pool.run(refused_heads):
            assert name == "BlockDiagCPError", message
            assert "4 query heads over the cp=3 ranks" in message and "--cp-kv-exchange a2a" in message, message
