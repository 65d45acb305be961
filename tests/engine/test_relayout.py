"""Re-laid attention (``relayout="balanced"``, ``blockdiag_cp/relayout.py``) on gloo at cp 2, 3 and 4.

In float64 against the single-process reference: the layouts a batch arrives in (contiguous,
zigzag, thd from padded ids) under every sequence exchange, both kv_backward modes, the
document cases of ``cases.py``, GQA and MLA head dims, sliding windows, learnable sinks and
dropout. Also: the rows each rank moves, counted from the two layouts' owners (independent of
the row moves), the knob's agreement and refusals on every rank, and the steps it leaves in
their own layout (balanced already, head-parallel).
"""

import pytest
import torch

from megatron_ext.testing import WorkerPool, catch, pool_fixture, pool_per_cp_fixture
from megatron_ext.testing.cases import CASES, make_doc_ids
from test_engine_dist import dropout_checks
from test_two_dim import planned_step
from test_ulysses import errors_against_reference, pipelined_order, posts_against_reference
from test_variants import _thd_padded

LAYOUTS = ("contiguous", "zigzag", "thd")
TOL = 1e-12
HEADS = (6, 2, 8, 4)  # (Hq, Hkv, Dqk, Dv): GQA and MLA's value dim


def _ids(case, S, cp, layout):
    doc_ids = make_doc_ids(case, S, cp)
    if layout == "thd":
        if doc_ids.dim() == 2:
            return None  # THD packs one row
        doc_ids = _thd_padded(doc_ids, 2 * cp)
    return doc_ids


def check_relaid(case, exchange, window=None, kv_backward=None, layouts=LAYOUTS, S=96, relayout="balanced"):
    """On every rank: {layout: ([errors of out, dq, dk, dv, dsink], report, rows this rank's positions
    send to other ranks by the balanced layout's owners, rows it receives, relaid)}."""
    import torch.distributed as dist

    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.blockdiag_cp.layouts import build_layout

    cp, rank = dist.get_world_size(), dist.get_rank()
    results = {}
    for layout in layouts:
        doc_ids = _ids(case, S, cp, layout)
        if doc_ids is None:
            continue
        errs, state = errors_against_reference(doc_ids, HEADS, window, lambda ids: bdcp.BlockDiagCPState.build(
            ids, layout=layout, kv_exchange=exchange, attn_backend="dense", kv_backward=kv_backward,
            relayout=relayout), seed=31)
        # Rows that change owner, from the layouts themselves (the balanced one as its strategy cuts
        # these ids, not as the state holds it).
        balanced = build_layout("balanced", state.doc_ids, cp)
        mine, owner = state.layout.positions, balanced.owner()
        sent = int((owner[mine[rank]] != rank).sum())
        received = int((state.layout.owner()[balanced.positions[rank]] != rank).sum())
        results[layout] = (errs, state.report(), sent, received, state.relaid is not None)
    return results


pool = pool_per_cp_fixture([2, 3, 4])
pool_two_nodes = pool_fixture(4, env={"LOCAL_WORLD_SIZE": "2"})  # hierarchical needs nodes of several ranks


def _row_bytes(b):
    hq, hkv, dk, dv = HEADS
    return b * 8 * (hq * dk + hkv * (dk + dv)), b * 8 * hq * dv  # q + k + v, out (float64)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("exchange", ["a2a", "allgather"])
def test_matches_reference_every_layout(pool, case, exchange):
    for rank, per_rank in enumerate(pool.run(check_relaid, case, exchange)):
        for layout, (errs, report, sent, received, relaid) in per_rank.items():
            assert max(errs) < TOL, (rank, layout, errs)
            assert relaid and report["relayout"] == "balanced" and report["layout"] == layout, report
            assert report["attended_layout"] == "balanced" and report["kv_exchange"] == exchange, report
            # q, k, v there and the output back: the rows that change owner, forward and backward alike.
            qkv, out = _row_bytes(2 if case == "b2" else 1)
            assert report["relayout_bytes_sent"] == sent * qkv + received * out, (layout, report, sent)
            assert report["relayout_bytes_received"] == received * qkv + sent * out, (layout, report)
            assert report["backward_relayout_bytes_sent"] == sent * out + received * qkv, (layout, report)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("exchange,kv_backward", [("halo", "auto"), ("hierarchical", "refetch"),
                                                  ("a2a", "save"), ("a2a", "refetch")])
@pytest.mark.parametrize("window", [None, 0, 5])
def test_exchanges_windows_and_sinks(pool, exchange, kv_backward, window):
    for rank, per_rank in enumerate(pool.run(check_relaid, "pad_middle", exchange, window, kv_backward)):
        for layout, (errs, report, *_rest, relaid) in per_rank.items():
            assert max(errs) < 1e-10, (rank, layout, window, errs)
            assert relaid, report


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["short", "pad_middle"])
def test_hierarchical_across_two_nodes(pool_two_nodes, case):
    for rank, per_rank in enumerate(pool_two_nodes.run(check_relaid, case, "hierarchical", 5)):
        for layout, (errs, report, *_rest, relaid) in per_rank.items():
            assert max(errs) < 1e-10, (rank, layout, errs)
            assert relaid and report["kv_exchange"] == "hierarchical", report


@pytest.mark.timeout(300)
def test_dropout_gradients_and_replayed_masks(pool):
    import megatron_ext.blockdiag_cp as bdcp

    try:
        pool.run(bdcp.configure_cp_relayout, "balanced")  # the knob, as a run's flags set it
        results = pool.run(dropout_checks, "zigzag", "a2a", "auto")
    finally:
        pool.run(bdcp.configure_cp_relayout)
    for r in results:
        assert abs(r["analytic"] - r["numeric"]) <= 1e-6 * max(1.0, abs(r["numeric"])), r
        assert r["out"] == r["same_seed"], r  # the same generator state draws the same masks
        assert r["other_seed"] != r["same_seed"] and r["clean"] != r["out"], r


def _left_alone(layout, exchange, ulysses_size=None):
    import megatron_ext.blockdiag_cp as bdcp

    doc_ids = make_doc_ids("short", 48, 2)
    state = bdcp.BlockDiagCPState.build(doc_ids, layout=layout, kv_exchange=exchange, attn_backend="dense",
                                        relayout="on", ulysses_size=ulysses_size)
    return state.relaid is None, state.report()["relayout_reason"]


@pytest.mark.timeout(120)
def test_steps_it_leaves_in_their_own_layout(pool):
    if pool.world != 2:
        pytest.skip("one cp is enough")
    for layout, exchange, words in (("balanced", "a2a", "laid out balanced already"),
                                    ("zigzag", "ulysses", "'ulysses'")):
        for alone, reason in pool.run(_left_alone, layout, exchange):
            assert alone and words in reason, (layout, exchange, reason)
    for alone, reason in pool.run(_left_alone, "zigzag", "a2a"):
        assert not alone and "'zigzag' to 'balanced'" in reason, reason
    for alone, reason in pool.run(_left_alone, "zigzag", "a2a", 2):  # ulysses_size = cp: head-parallel
        assert alone and "splits the step itself" in reason, reason


def relaid_posts(needs_grad):
    """``posts_against_reference`` of a2a relaid to balanced: (orders, errors, the report, the rows this rank's
    positions send to other ranks by the balanced layout's owners, the rows it receives from them)."""
    import torch.distributed as dist

    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.blockdiag_cp.layouts import build_layout

    rank = dist.get_rank()
    orders, errors, state = posts_against_reference(HEADS, needs_grad, lambda ids: bdcp.BlockDiagCPState.build(
        ids, layout="zigzag", kv_exchange="a2a", attn_backend="dense", relayout="balanced"), seed=7)
    balanced = build_layout("balanced", state.doc_ids, state.cp)
    sent = int((balanced.owner()[state.layout.positions[rank]] != rank).sum())
    received = int((state.layout.owner()[balanced.positions[rank]] != rank).sum())
    return orders, errors, state.report(), sent, received


@pytest.mark.timeout(120)
def test_head_groups_are_pipelined_one_ahead(pool):
    """6 query heads over 2 K / V heads go in 2 groups, K / V split alike (the balanced layout's attention
    exchanges K / V per call, so they move with their group): each group's q, k and v move while the group
    before it is attended, its output goes home as soon as attended; backward does the same with the
    output's gradient and dq, dK and dV home (only those an input needs: here every one, or q's alone).
    The gradients match the reference, and the bytes moved are every group's."""
    if pool.world != 2:
        pytest.skip("one cp is enough")
    hq, hkv, dk, dv = HEADS
    for needs_grad, back in (((True, True, True), 3), ((True, False, False), 1)):
        for (forward, backward), errors, report, sent, received in pool.run(relaid_posts, needs_grad):
            assert max(errors) < TOL and len(errors) == 1 + back, (needs_grad, errors)
            firsts = [min(n for kind, n in order if kind == "post") for order in (forward, backward)]
            want_forward, want_backward = pipelined_order(2, False, needs_grad, firsts)
            assert forward == want_forward, forward
            assert backward == want_backward, backward
            # back: the output's gradient there, and the inputs' gradients asked for home
            grads = 8 * (hq * dk + (hkv * (dk + dv) if back == 3 else 0))
            assert report["backward_relayout_bytes_sent"] == sent * 8 * hq * dv + received * grads, report


def _build_with(relayout_by_rank):
    import torch.distributed as dist

    import megatron_ext.blockdiag_cp as bdcp

    relayout = relayout_by_rank[dist.get_rank()]
    return catch(lambda: bdcp.BlockDiagCPState.build(make_doc_ids("short", 48, 2), layout="thd",
                                                     attn_backend="dense", relayout=relayout))


@pytest.mark.timeout(120)
def test_bad_or_differing_knob_is_refused_on_every_rank():
    import megatron_ext.blockdiag_cp as bdcp

    with pytest.raises(ValueError, match="unknown relayout 'sideways'; accepted values: .*balanced"):
        bdcp.normalize_relayout("sideways")
    assert bdcp.normalize_relayout("On") == "balanced" and bdcp.normalize_relayout(None) == "none"
    with WorkerPool(2) as pool:
        got = pool.run(_build_with, ["sideways", "balanced"])
        assert [name for name, _ in got] == ["BlockDiagCPError"] * 2, got
        assert "unknown relayout 'sideways'" in got[0][1] and "CP rank 0" in got[1][1], got
        got = pool.run(_build_with, ["balanced", "none"])
        assert [name for name, _ in got] == ["BlockDiagCPError"] * 2, got
        assert all("relayout ('balanced' vs 'none')" in message for _, message in got), got


def _long_and_short(S=4096):
    """One document of S / 2, then documents of 16: contiguous gives the long one's rank the most work."""
    from megatron_ext.testing import runs_to_doc_ids

    return runs_to_doc_ids([(1, S // 2)] + [(i + 2, 16) for i in range(S // 32)])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout,ids,moved", [("contiguous", "long_and_short", True), ("zigzag", "short", False)])
def test_planned_offers_the_relaid_options_with_the_knob(pool, layout, ids, moved):
    if pool.world != 4:
        pytest.skip("priced at cp 4")
    ids = _long_and_short() if ids == "long_and_short" else make_doc_ids(ids, 96, 4)
    offered = ("a2a", 1)  # and, with the knob, the relaid options
    for report, priced, err in pool.run(planned_step, ids, 4, 4, offered, layout, "balanced"):
        assert err < TOL, err
        best = min((o for o in priced if not o[2]), key=lambda o: o[1])[0]
        assert [o["name"] for o in report["planned_options"]][0] == best, (report["planned_options"], priced)
        assert (best == "relaid a2a") == moved and (report["attended_layout"] == "balanced") == moved, report
        assert report["relayout_reason"].startswith("planned: q/k/v moved" if moved else "planned: an option"), report
    for report, priced, err in pool.run(planned_step, ids, 4, 4, offered, layout, "none"):  # without the knob
        assert err < TOL and [o["name"] for o in report["planned_options"]] == ["a2a"], report
