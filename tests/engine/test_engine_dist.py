"""Engine correctness on real gloo process groups (cp = 1 to 4) against the reference.

Every layout x exchange x kv_backward (refetch / save), on the document cases in
cases.py (documents split across chunks, empty chunks, all-padding ranks, GQA), in
float64: output and gradients of q, k and v equal a single-process per-document
causal reference. Dropout, which has no reference, is checked by a directional
finite difference of the whole group's loss and by replaying the same masks.
"""

import pytest
import torch

from megatron_ext.testing import pool_fixture, pool_per_cp_fixture, reference_attention
from megatron_ext.testing.cases import CASES, make_doc_ids

LAYOUTS = ("contiguous", "zigzag", "balanced")
EXCHANGES = ("allgather", "halo", "a2a")
TOL = 1e-5


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _inputs(case, S, cp, b, hq, hkv, d):
    doc_ids = make_doc_ids(case, S, cp)
    S = doc_ids.shape[-1]  # "uneven" is shorter than asked: not a multiple of 2 * cp
    g = torch.Generator().manual_seed(7)
    q = torch.randn(S, b, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(S, b, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(S, b, hkv, d, generator=g, dtype=torch.float64)
    w = torch.randn(S, b, hq, d, generator=g, dtype=torch.float64)
    return doc_ids, q, k, v, w


def check_case(case, S, b, hq, hkv, d, layouts=LAYOUTS, exchanges=EXCHANGES, scale=None,
               kv_backwards=("refetch", "save")):
    """Runs on every rank; returns {(layout, exchange, kv_backward): (errors..., report)}."""
    import megatron_ext.blockdiag_cp as bdcp

    cp = torch.distributed.get_world_size()
    doc_ids, q, k, v, w = _inputs(case, S, cp, b, hq, hkv, d)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*ref_in, doc_ids, scale=scale)
    (ref * w).sum().backward()
    results = {}
    for layout in layouts:
        for exchange in exchanges:
            for kv_backward in kv_backwards:
                state = bdcp.BlockDiagCPState.build(doc_ids, layout=layout, kv_exchange=exchange,
                                                    attn_backend="dense", kv_backward=kv_backward)
                local = [state.shard(t).detach().requires_grad_() for t in (q, k, v)]
                with bdcp.blockdiag_cp_step(state):
                    out = bdcp.blockdiag_cp_attention(*local, softmax_scale=scale)
                    (out * state.shard(w)).sum().backward()
                errs = [_rel(out, state.shard(ref))] + [
                    _rel(t.grad, state.shard(r.grad)) for t, r in zip(local, ref_in)]
                results[(layout, exchange, kv_backward)] = (errs, state.report())
    return results


pool = pool_per_cp_fixture([1, 2, 3, 4])
pool_two_nodes = pool_fixture(4, env={"LOCAL_WORLD_SIZE": "2"})  # hierarchical needs nodes of several ranks


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES)
def test_matches_reference_every_layout_and_exchange(pool, case):
    b = 2 if case == "b2" else 1
    results = pool.run(check_case, case, 96, b, 4, 2, 8)  # GQA: 4 query heads, 2 kv heads
    cp = len(results)
    for rank, per_rank in enumerate(results):
        for (layout, exchange, kv_backward), (errs, report) in per_rank.items():
            assert max(errs) < TOL, (rank, layout, exchange, kv_backward, errs)
            assert report["layout"] == layout
            assert report["kv_backward"] == (kv_backward if cp > 1 else "save"), report


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES)
def test_matches_reference_with_the_hierarchical_exchange_on_2_nodes_of_2(pool_two_nodes, case):
    b = 2 if case == "b2" else 1  # b2: a row of doc ids per batch row
    results = pool_two_nodes.run(check_case, case, 96, b, 4, 2, 8, LAYOUTS, ("hierarchical",))
    for rank, per_rank in enumerate(results):
        for (layout, exchange, kv_backward), (errs, report) in per_rank.items():
            assert max(errs) < TOL, (rank, layout, kv_backward, errs)
            assert report["kv_exchange"] == "hierarchical" and report["kv_backward"] == kv_backward, report


@pytest.mark.timeout(300)
def test_batch_rows_share_doc_ids_without_gqa_and_custom_scale(pool):
    results = pool.run(check_case, "short", 64, 3, 3, 3, 4, LAYOUTS, EXCHANGES, 0.37)
    for per_rank in results:
        for key, (errs, _) in per_rank.items():
            assert max(errs) < TOL, (key, errs)


def dropout_checks(layout, exchange, kv_backward):
    """Dropout on every rank: a directional derivative of the group's loss, and replayed masks."""
    import torch.distributed as dist

    import megatron_ext.blockdiag_cp as bdcp

    cp = torch.distributed.get_world_size()
    doc_ids, q, k, v, w = _inputs("short", 48, cp, 1, 4, 2, 4)
    state = bdcp.BlockDiagCPState.build(doc_ids, layout=layout, kv_exchange=exchange, attn_backend="dense",
                                        kv_backward=kv_backward)
    local = [state.shard(t).detach() for t in (q, k, v)]
    g = torch.Generator().manual_seed(11 + dist.get_rank())
    direction = [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in local]
    weight = state.shard(w)

    def loss(inputs, seed=5):
        torch.manual_seed(seed)  # the op draws its dropout seed from here: same masks each time
        with bdcp.blockdiag_cp_step(state):
            return (bdcp.blockdiag_cp_attention(*inputs, dropout_p=0.3) * weight).sum()

    leaves = [t.clone().requires_grad_() for t in local]
    with bdcp.blockdiag_cp_step(state):
        torch.manual_seed(5)
        out = bdcp.blockdiag_cp_attention(*leaves, dropout_p=0.3)
        (out * weight).sum().backward()
    analytic = torch.tensor(sum(float((t.grad * d).sum()) for t, d in zip(leaves, direction)), dtype=torch.float64)
    eps = 1e-6
    with torch.no_grad():
        plus = loss([t + eps * d for t, d in zip(local, direction)])
        minus = loss([t - eps * d for t, d in zip(local, direction)])
    numeric = (plus - minus) / (2 * eps)
    for x in (analytic, numeric):
        dist.all_reduce(x)  # the group's loss: every rank's outputs depend on every rank's K/V
    with torch.no_grad():
        again = [loss(local, seed=5), loss(local, seed=6)]
    with bdcp.blockdiag_cp_step(state):
        clean = float((bdcp.blockdiag_cp_attention(*local) * weight).sum())
    return {"analytic": float(analytic), "numeric": float(numeric), "same_seed": float(again[0]),
            "out": float((out.detach() * weight).sum()), "other_seed": float(again[1]), "clean": clean,
            "zeroed": float((out == 0).double().mean())}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout,exchange,kv_backward", [
    ("zigzag", "allgather", "refetch"), ("contiguous", "a2a", "save"), ("balanced", "halo", "refetch")])
def test_dropout_gradients_and_replayed_masks(pool, layout, exchange, kv_backward):
    for r in pool.run(dropout_checks, layout, exchange, kv_backward):
        assert abs(r["analytic"] - r["numeric"]) <= 1e-6 * max(1.0, abs(r["numeric"])), r
        assert r["out"] == r["same_seed"], r  # the same generator state draws the same masks
        assert r["other_seed"] != r["same_seed"] and r["clean"] != r["out"], r  # dropout did something


def kv_backward_knobs():
    import megatron_ext.blockdiag_cp as bdcp

    cp = torch.distributed.get_world_size()
    single, short = torch.ones(96, dtype=torch.long), make_doc_ids("short", 96, cp)
    out = {}
    bdcp.configure_cp_kv_backward("refetch")
    try:
        out["configured"] = bdcp.BlockDiagCPState.build(short, attn_backend="dense").report()
    finally:
        bdcp.configure_cp_kv_backward()
    _, state = bdcp.shard_batch({"tokens": torch.zeros(1, 96, dtype=torch.long), "doc_ids": short},
                                attn_backend="dense", kv_backward="keep")
    out["shard_batch"] = state.report()
    for name, ids, exchange in (("single_allgather", single, "allgather"), ("short_a2a", short, "a2a"),
                                ("single_a2a", single, "a2a")):
        out[name] = bdcp.BlockDiagCPState.build(ids, attn_backend="dense", kv_exchange=exchange).report()
    return out


@pytest.mark.timeout(120)
def test_kv_backward_knob_and_auto(pool):
    cp = len(pool.run(_world))
    for r in pool.run(kv_backward_knobs):
        if cp == 1:
            assert all(rep["kv_backward"] == "save" for rep in r.values())
            continue
        assert (r["configured"]["kv_backward_requested"], r["configured"]["kv_backward"]) == ("refetch", "refetch")
        assert (r["shard_batch"]["kv_backward_requested"], r["shard_batch"]["kv_backward"]) == ("save", "save")
        # auto: the ring brings (cp - 1) shards; saving them fits the 1x-local budget only at cp = 2.
        assert r["single_allgather"]["kv_backward"] == ("save" if cp == 2 else "refetch"), r["single_allgather"]
        assert r["short_a2a"]["kv_backward"] == "save", r["short_a2a"]  # short documents: a few rows
        assert r["single_allgather"]["kv_backward_reason"].startswith("auto:")


def _world():
    return torch.distributed.get_world_size()
