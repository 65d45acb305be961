"""Issue 19: the hierarchical K/V exchange (a node's remote rows cross nodes once).

The routes (``hierarchy``) are checked without processes against the plan's own
tables on many layouts and topologies; the transport (``hierarchical_exchange``)
on 4 gloo ranks as 2 nodes x 2 (``LOCAL_WORLD_SIZE=2``) against the needed-only buffer built from an
all-gather, forward and backward, with the bytes that cross a node boundary counted.
"""

from dataclasses import fields

import pytest
import torch

import megatron_ext.blockdiag_cp as bdcp
from megatron_ext.blockdiag_cp.cost import CostModel
from megatron_ext.blockdiag_cp.hierarchy import build_hierarchical_route, layout_traffic, node_routes
from megatron_ext.blockdiag_cp.intervals import document_runs, overlap_counts, work_and_intervals
from megatron_ext.blockdiag_cp.layouts import build_layout, padded_length
from megatron_ext.blockdiag_cp.plan import build_plan
from megatron_ext.testing import pool_fixture


def _ids(kind, S, seed, rows=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        if kind == "single":
            row = torch.ones(S, dtype=torch.long)
        else:
            top = {"short": 8, "mixed": 60, "long": S}[kind]
            lengths = torch.randint(1, max(2, top), (S,), generator=g)
            row = torch.repeat_interleave(torch.arange(1, S + 1), lengths)[:S]
            row = torch.where(torch.rand(S, generator=g) < 0.05, torch.zeros_like(row), row)
        out.append(row)
    return torch.stack(out)


def _layout(kind, S, cp, per_node, name, seed=0, rows=1):
    ids = _ids(kind, S, seed, rows)
    ids = torch.nn.functional.pad(ids, (0, padded_length(S, name, cp) - S))
    return ids, build_layout(name, ids, cp, CostModel.two_level(per_node))


def _simulate(routes, local):
    """Run both stages of every rank's route in one process: rows carry their global position."""
    cp = len(routes)
    send1 = [list(torch.split(local[r][routes[r].send1_index], routes[r].send1_counts)) for r in range(cp)]
    recv1 = [torch.cat([send1[s][r] for s in range(cp)]) for r in range(cp)]
    send2 = [list(torch.split(recv1[r][routes[r].send2_index], routes[r].send2_counts)) for r in range(cp)]
    recv2 = [torch.cat([send2[s][r] for s in range(cp)]) for r in range(cp)]
    outs = []
    for r, rt in enumerate(routes):
        out = torch.full((rt.out_rows,), -1, dtype=torch.long)
        out[:rt.local_len] = local[r]
        keep = rt.slot1 >= 0
        # The op copies the kept rows through precomputed indices: the same rows, in the same order.
        assert torch.equal(rt.kept1, keep.nonzero().flatten()) and torch.equal(rt.kept1_slot, rt.slot1[keep])
        out[rt.slot1[keep]] = recv1[r][keep]
        out[rt.slot2] = recv2[r]
        outs.append(out)
    return outs


@pytest.mark.parametrize("cp,per_node", [(4, 2), (8, 2), (8, 4), (6, 3), (4, 1)])
def test_routes_deliver_the_needed_buffer_and_cross_each_node_once(cp, per_node):
    for seed, (kind, S, rows) in enumerate([("short", 97, 1), ("mixed", 230, 1), ("long", 180, 1),
                                            ("single", 64, 1), ("mixed", 120, 2)][:5 if cp <= 4 else 3]):
        for name in ("contiguous", "zigzag", "balanced"):
            ids, lay = _layout(kind, S, cp, per_node, name, seed, rows)
            routes = [build_hierarchical_route(lay, ids, r, per_node) for r in range(cp)]
            outs = _simulate(routes, [lay.positions[r] for r in range(cp)])
            remote = {}  # node -> positions its ranks need from other nodes (brute force from the plan)
            for r in range(cp):
                ex = build_plan(ids, lay, r, kinds=()).exchange
                want = torch.cat([lay.positions[r]] + list(ex.recv_positions))
                assert torch.equal(outs[r], want), (kind, name, r)
                for s in range(cp):
                    if s // per_node != r // per_node:
                        remote.setdefault(r // per_node, set()).update(ex.recv_positions[s].tolist())
            # Each remote position a node needs crosses a node boundary exactly once.
            assert sum(rt.inter1_recv for rt in routes) == sum(len(v) for v in remote.values())
            assert sum(rt.inter1_send for rt in routes) == sum(rt.inter1_recv for rt in routes)
            # ... and the node's NICs share it: every fetcher within one row per source of the even share.
            for node, need in remote.items():
                got = [routes[r].inter1_recv for r in range(node * per_node, (node + 1) * per_node)]
                assert max(got) - min(got) <= cp, (got, len(need))


def test_two_level_traffic_equals_a_hand_count():
    """cp 4 = 2 nodes x 2, one document of 16 tokens, contiguous: ranks own 4 tokens each."""
    ids = torch.ones(1, 16, dtype=torch.long)
    lay = build_layout("contiguous", ids, 4)
    rows = [document_runs(ids[0])]
    # Flat (every rank fetches its own rows): rank r needs the 4r tokens before it.
    flat = layout_traffic(lay.runs, rows, CostModel.two_level(2, hierarchical=False))
    assert flat.intra_in.tolist() == [0, 4, 0, 4]  # ranks 1 and 3 fetch their node peer's 4
    assert flat.inter_in.tolist() == [0, 0, 8, 8]  # ranks 2 and 3 both fetch node 0's 8 tokens
    assert flat.inter_out.tolist() == [8, 8, 0, 0]  # rank 0 sends its 4 to rank 2 and to rank 3
    assert flat.intra_out.tolist() == [4, 0, 4, 0]
    # Hierarchical: node 1 needs tokens 0-7 once; rank 2 fetches 0-3 (from rank 0), rank 3 fetches 4-7.
    hier = layout_traffic(lay.runs, rows, CostModel.two_level(2))
    assert hier.inter_in.tolist() == [0, 0, 4, 4]
    assert hier.inter_out.tolist() == [4, 4, 0, 0]
    # NVLink: rank 3 gets 4 from rank 2 (direct) + 4 forwarded (0-3); rank 2 gets 4-7 forwarded by 3.
    assert hier.intra_in.tolist() == [0, 4, 4, 8]
    assert hier.intra_out.tolist() == [4, 0, 8, 4]
    assert hier.intra_messages.tolist() == [1, 1, 2, 2] and hier.inter_messages.tolist() == [1, 1, 1, 1]
    # Priced: rank 3 is the busiest: 8 NVLink positions (in) + 4 IB positions.
    cm = CostModel.two_level(2)
    work = torch.tensor([10, 26, 42, 58])  # 4r*4 + 10 pairs each
    assert cm.modeled_seconds(work, hier) == pytest.approx(
        58 * cm.seconds_per_pair + 8 * cm.seconds_per_position + 4 * cm.seconds_per_position_inter)
    flat_cost = max(w * cm.seconds_per_pair + max(i, o) * cm.seconds_per_position
                    + max(ii, oo) * cm.seconds_per_position_inter
                    for w, i, o, ii, oo in zip(work.tolist(), flat.intra_in.tolist(), flat.intra_out.tolist(),
                                               flat.inter_in.tolist(), flat.inter_out.tolist()))
    assert cm.modeled_seconds(work, flat) == pytest.approx(flat_cost)


def test_one_level_and_single_node_models_price_every_pair_on_one_link():
    ids = _ids("mixed", 200, 3)
    lay = build_layout("zigzag", ids, 4)
    rows = [document_runs(ids[0])]
    _, dst, a, b = work_and_intervals(lay.runs, rows)
    counts = overlap_counts(lay.runs, dst, a, b)
    for cm in (CostModel.preset("ib"), CostModel.two_level(4), CostModel.two_level(8)):
        t = layout_traffic(lay.runs, rows, cm)
        assert torch.equal(t.intra_in, counts.sum(0)) and torch.equal(t.intra_out, counts.sum(1))
        assert int(t.inter_in.sum()) == 0
    routes = node_routes(lay.runs, dst, a, b, 1)  # every rank its own node: IB straight to the owner
    assert torch.equal(routes.fetch_counts(), counts) and routes.forward_fetcher.numel() == 0


# -- the transport on 4 gloo ranks, 2 nodes x 2 -----------------------------------------------------

pool4 = pool_fixture(4, env={"LOCAL_WORLD_SIZE": "2"})

TRANSPORT_CASES = [("single", 64, 1, "contiguous"), ("single", 64, 1, "zigzag"), ("short", 90, 1, "zigzag"),
                   ("mixed", 150, 1, "balanced"), ("long", 120, 1, "contiguous"), ("mixed", 100, 2, "zigzag"),
                   ("long", 200, 1, "balanced")]


def _needed_by_allgather(kv, lay, plan, group):
    """The needed-only buffer, independently: every rank's rows all-gathered (differentiable), then this
    rank's local rows and, per source in rank order, the positions it receives, ascending."""
    import torch.distributed.nn.functional as dist_fn

    everyone = torch.cat(dist_fn.all_gather(kv, group=group))  # [cp * L, ...] rank-major
    flat_of = torch.empty(lay.padded_len, dtype=torch.long)
    flat_of[lay.runs.positions().flatten()] = torch.arange(lay.padded_len)
    received = torch.cat(plan.exchange.recv_positions)
    return torch.cat([kv, everyone.index_select(0, flat_of[received])])


def transport_matches_needed_kv(cases, use_p2p):
    import torch.distributed as dist

    from megatron_ext import parallel_state as ps
    from megatron_ext.blockdiag_cp.hierarchical_exchange import hierarchical_needed_kv

    group, rank, cp = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    per_node = ps.local_world_size()
    out = []
    for i, (kind, S, rows, name) in enumerate(cases):
        ids, lay = _layout(kind, S, cp, per_node, name, seed=i, rows=rows)
        plan = build_plan(ids, lay, rank, kinds=())
        route = build_hierarchical_route(lay, ids, rank, per_node)
        g = torch.Generator().manual_seed(100 * i + rank)
        kv = torch.randn(lay.local_len, 2, 6, generator=g, dtype=torch.float64)
        k1, k2 = kv.clone().requires_grad_(True), kv.clone().requires_grad_(True)
        hier_stats = {}
        ref = _needed_by_allgather(k1, lay, plan, group)
        got = hierarchical_needed_kv(k2, route, group, hier_stats, use_p2p=use_p2p)
        upstream = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7 * i + rank),
                               dtype=torch.float64)
        (ref * upstream).sum().backward()
        (got * upstream).sum().backward()
        # Flat inter-node rows this rank receives: its needs from the other node.
        counts = plan.exchange.counts
        flat_inter = int(sum(counts[s, rank] for s in range(cp) if s // per_node != rank // per_node))
        out.append({"forward_equal": torch.equal(ref, got), "grad_err": float((k1.grad - k2.grad).abs().max()),
                    "inter_recv_bytes": hier_stats["bytes_inter_node_received"],
                    "inter_sent_bytes": hier_stats["bytes_inter_node_sent"],
                    "flat_inter_recv_bytes": flat_inter * kv[0].numel() * kv.element_size(),
                    "row_bytes": kv[0].numel() * kv.element_size(), "local_len": lay.local_len,
                    "per_node": per_node})
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("use_p2p", [False, True])
def test_transport_equals_needed_kv_forward_and_backward_on_2_nodes_of_2(pool4, use_p2p):
    results = pool4.run(transport_matches_needed_kv, TRANSPORT_CASES, use_p2p)
    for i, case in enumerate(TRANSPORT_CASES):
        per_rank = [r[i] for r in results]
        assert all(r["per_node"] == 2 for r in per_rank)
        for r in per_rank:
            assert r["forward_equal"], case
            assert r["grad_err"] < 1e-12, (case, r["grad_err"])
        recv = sum(r["inter_recv_bytes"] for r in per_rank)
        assert recv == sum(r["inter_sent_bytes"] for r in per_rank)
        assert recv <= sum(r["flat_inter_recv_bytes"] for r in per_rank)
        if case[0] == "single" and case[3] == "contiguous":
            # One document: node 1 (ranks 2, 3) needs node 0's 2L rows; they cross once, not once per rank.
            L, row = per_rank[0]["local_len"], per_rank[0]["row_bytes"]
            assert recv == 2 * L * row
            assert sum(r["flat_inter_recv_bytes"] for r in per_rank) == 4 * L * row
            assert [r["inter_recv_bytes"] for r in per_rank] == [0, 0, L * row, L * row]


# -- the hierarchical exchange inside the attention op --------------------------------------------


def op_with_hierarchical_exchange(case, layout, kv_backward, window, prepared=False):
    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext import parallel_state as ps
    from megatron_ext.testing import reference_attention
    from megatron_ext.testing.cases import make_doc_ids
    from megatron_ext.testing.op_counter import OpCounter

    cp = torch.distributed.get_world_size()
    ids = make_doc_ids(case, 96, cp)
    g = torch.Generator().manual_seed(5)
    q, k, v, w = (torch.randn(96, 1, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    (reference_attention(*ref_in, ids, window=window) * w).sum().backward()
    out = {}
    for exchange in ("hierarchical", "a2a"):
        prep = None
        if prepared:  # planned ahead, the route too (as the pretrain script's planning thread does)
            prep = bdcp.prepare_plan(ids, cp, torch.distributed.get_rank(), layout=layout, kinds=("needed",),
                                     kv_exchange=exchange, ranks_per_node=ps.cp_ranks_per_node())
        state = bdcp.BlockDiagCPState.build(ids, layout=layout, kv_exchange=exchange, attn_backend="dense",
                                            kv_backward=kv_backward, prepared=prep)
        route_planned = prep is not None and prep.route is not None and state._host_routes.get(None) is prep.route
        local = [state.shard(t).detach().requires_grad_() for t in (q, k, v)]
        window_size = None if window is None else (window, 0)
        with bdcp.blockdiag_cp_step(state):
            o = bdcp.blockdiag_cp_attention(*local, window_size=window_size)
            # A second layer on the same state: each call's figures are its own, not a running sum.
            o2 = bdcp.blockdiag_cp_attention(*(t.detach() for t in local), window_size=window_size)
            counter = OpCounter()
            with counter, counter.region("backward"):
                (o * state.shard(w)).sum().backward()
        ref = reference_attention(q, k, v, ids, window=window)
        errs = [float((o - state.shard(ref)).abs().max()), float((o2 - o).abs().max())] + [
            float((t.grad - state.shard(r.grad)).abs().max()) for t, r in zip(local, ref_in)]
        report = state.report()
        stats = state.comm_stats
        key_plan, _, _ = state.key_merges_on("needed", torch.device("cpu"), window)
        sent = [t for t in state.plan_for(window).exchange.send_index if t.numel()]
        returned = state.hierarchical_route_on(torch.device("cpu"), window).send1_index if exchange == "hierarchical" else None
        out[exchange] = {"errs": errs, "key_merged": key_plan.merged_mask.nonzero()[0].tolist(),
                         "local_len": state.local_len,
                         "sent": torch.cat(sent).unique().tolist() if sent else [],
                         "returned": None if returned is None else returned.unique().tolist(),
                         "returned_twice": returned is not None and returned.unique().numel() < returned.numel(),
                         "row_ops": {op: counter.counts["backward"].ops.get(op, 0) for op in ("sum_rows_", "add_rows_")},
                         "exchange": report["kv_exchange"], "kv_backward": report["kv_backward"],
                         "report": {k: v for k, v in report.items() if "positions" in k or "bytes" in k},
                         "stats": {k: v for k, v in stats.items() if "bytes" in k},
                         "route_planned": route_planned, "route_is_prepared": state._host_routes.get(None) is (
                             None if prep is None else prep.route)}
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case,layout,kv_backward,window", [
    ("single", "contiguous", "refetch", None), ("single", "zigzag", "save", None),
    ("pad_middle", "balanced", "refetch", None),  # on "short" balanced needs no keys: nothing would move
    ("single", "zigzag", "refetch", 9), ("pad_middle", "contiguous", "save", 30)])
def test_op_with_the_hierarchical_exchange_on_2_nodes_of_2(pool4, case, layout, kv_backward, window):
    merged_rows, sums = [], []
    for r in pool4.run(op_with_hierarchical_exchange, case, layout, kv_backward, window):
        hier, flat = r["hierarchical"], r["a2a"]
        assert hier["exchange"] == "hierarchical" and hier["kv_backward"] == kv_backward, hier
        assert max(hier["errs"]) < 1e-10 and max(flat["errs"]) < 1e-10, (hier, flat)
        rep, stats = hier["report"], hier["stats"]
        row = rep["kv_row_bytes"]
        # The bytes the routes moved are the route's positions, per call (two layers ran), both ways.
        assert stats["bytes_received"] == rep["positions_received"] * row, hier
        assert stats["bytes_sent"] == rep["positions_sent"] * row, hier
        assert stats["bytes_inter_node_received"] == rep["positions_inter_node_received"] * row, hier
        assert stats["bytes_inter_node_sent"] == rep["positions_inter_node_sent"] * row, hier
        # Gradients go back through the same routes: what came in goes out, and vice versa.
        assert stats["backward_grad_bytes_sent"] == stats["bytes_received"], hier
        assert stats["backward_grad_bytes_received"] == stats["bytes_sent"], hier
        if kv_backward == "refetch":
            assert stats["backward_bytes_received"] == stats["bytes_received"], hier
        else:
            assert stats["backward_bytes_received"] == 0, hier
        # A node's remote rows cross once: never more inter-node rows than the flat exchange moves.
        assert rep["positions_inter_node_received"] <= flat["report"]["positions_received"], (hier, flat)
        # The routes bring gradients home to the rows some rank needs (stage 1 sends each to a peer or to a
        # node's fetcher); the own keys' float32 buffer holds those (and rows three local calls attend).
        assert hier["returned"] == hier["sent"], hier
        assert set(hier["sent"]) <= set(hier["key_merged"]), hier
        # A row stage 1 sent to several ranks comes home several times in the routes' one return: each
        # buffer row's arrivals summed in one op (``sum_rows_``), exact as above
        assert hier["row_ops"]["sum_rows_"] == int(hier["returned_twice"]), hier
        sums.append(hier["row_ops"]["sum_rows_"])
        merged_rows.append(len(hier["key_merged"]) / hier["local_len"])
    if case == "pad_middle" and layout == "balanced":  # short documents: some ranks send no keys at all
        assert min(merged_rows) == 0.0, merged_rows
    if (case, layout) == ("single", "zigzag") and window is None:  # every rank's rows go to both other ranks
        assert sums == [1] * 4, sums


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case,layout,window", [("single", "zigzag", None), ("short", "balanced", None)])
def test_the_hierarchical_route_planned_ahead_is_the_one_the_step_uses(pool4, case, layout, window):
    for r in pool4.run(op_with_hierarchical_exchange, case, layout, "refetch", window, True):
        hier, flat = r["hierarchical"], r["a2a"]
        assert hier["exchange"] == "hierarchical" and hier["route_planned"] and hier["route_is_prepared"], hier
        assert not flat["route_planned"], flat  # a2a plans no route
        assert max(hier["errs"]) < 1e-10 and max(flat["errs"]) < 1e-10, (hier, flat)


def test_prepare_plan_plans_the_route_the_build_would():
    ids = torch.repeat_interleave(torch.arange(1, 9), torch.tensor([30, 2, 17, 50, 1, 9, 40, 11]))
    for layout in ("contiguous", "zigzag", "balanced"):
        prep = bdcp.prepare_plan(ids, 4, 2, layout=layout, kinds=(), kv_exchange="hier", ranks_per_node=2)
        want = build_hierarchical_route(prep.layout, prep.doc_ids, 2, 2)
        assert prep.ranks_per_node == 2
        for f in fields(want):
            a, b = getattr(prep.route, f.name), getattr(want, f.name)
            assert torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b, (layout, f.name)
    # Where the build falls back to a2a (one node, one rank per node) there is no route to plan.
    assert bdcp.prepare_plan(ids, 4, 0, kv_exchange="hierarchical", ranks_per_node=4).route is None
    assert bdcp.prepare_plan(ids, 4, 0, kv_exchange="hierarchical", ranks_per_node=1).route is None
    assert bdcp.prepare_plan(ids, 4, 0, kv_exchange="a2a").route is None
    with pytest.raises(ValueError, match="needs ranks_per_node"):
        bdcp.prepare_plan(ids, 4, 0, kv_exchange="hierarchical")


def hierarchical_on_one_node():
    import megatron_ext.blockdiag_cp as bdcp

    state = bdcp.BlockDiagCPState.build(torch.ones(32, dtype=torch.long), kv_exchange="hierarchical",
                                        attn_backend="dense")
    strict = None
    try:
        bdcp.BlockDiagCPState.build(torch.ones(32, dtype=torch.long), kv_exchange="hier", attn_backend="dense",
                                    strict=True)
    except bdcp.BlockDiagCPError as exc:
        strict = str(exc)
    return state.report()["kv_exchange"], state.report()["kv_exchange_reason"], strict


pool2_one_node = pool_fixture(2, env={"LOCAL_WORLD_SIZE": "2"})


@pytest.mark.timeout(120)
def test_hierarchical_on_one_node_falls_back_to_a2a_or_raises_in_strict(pool2_one_node):
    for exchange, reason, strict in pool2_one_node.run(hierarchical_on_one_node):
        assert exchange == "a2a" and "all 2 CP ranks sit on one node" in reason, reason
        assert strict is not None and "strict mode" in strict and "hierarchical" in strict
