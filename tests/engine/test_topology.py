"""Issue 19: the two-level cost model (prices by link, overlap), the node-aware balanced layout,
the launch's topology, and a real cp 4 = 2 nodes x 2 build that trains like the reference."""

import itertools

import pytest
import torch

from megatron_ext.blockdiag_cp.cost import CostModel, Traffic
from megatron_ext.blockdiag_cp.hierarchy import layout_traffic
from megatron_ext.blockdiag_cp.intervals import document_runs, pair_work, work_and_intervals
from megatron_ext.blockdiag_cp.layouts import build_layout, padded_length
from megatron_ext.testing import pool_fixture
from megatron_ext.testing import gpt as H


def _ids(S, seed, top=20, hole=0.0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, top, (S,), generator=g)
    ids = torch.repeat_interleave(torch.arange(1, S + 1), lengths)[:S]
    return torch.where(torch.rand(S, generator=g) < hole, torch.zeros_like(ids), ids).unsqueeze(0)


def _brute_traffic(ids_row, positions, g, hierarchical):
    """Per rank (intra in, intra out, inter in, inter out), position by position from the doc ids.

    Flat: every needed (position, rank) pair crosses the link between owner and rank.
    Hierarchical: node N's remote rows R(N) (needed by a rank of N, owned outside N), in
    position order, cut into g equal windows; window j is fetched over IB by N's rank j and
    forwarded over NVLink to every other rank of N that needs its rows.
    """
    cp, P = len(positions), len(ids_row)
    owner = {p: r for r, row in enumerate(positions) for p in row}
    start = [0] * P
    for p in range(1, P):
        start[p] = start[p - 1] if ids_row[p] == ids_row[p - 1] else p
    need = []
    for row in positions:
        wanted = set()
        for p in row:
            if ids_row[p] > 0:
                wanted.update(range(start[p], p + 1))
        need.append(wanted - set(row))
    node = lambda r: r // g  # noqa: E731
    t = {k: [0] * cp for k in ("intra_in", "intra_out", "inter_in", "inter_out")}
    for d in range(cp):
        for p in need[d]:
            s = owner[p]
            if node(s) == node(d):
                t["intra_in"][d] += 1
                t["intra_out"][s] += 1
            elif not hierarchical:
                t["inter_in"][d] += 1
                t["inter_out"][s] += 1
    if hierarchical:
        for n in range(cp // g):
            members = range(n * g, (n + 1) * g)
            remote = sorted({p for d in members for p in need[d] if node(owner[p]) != n})
            for k, p in enumerate(remote):
                # window j holds rows [floor(j |R| / g), floor((j + 1) |R| / g)) of R(N)
                fetcher = n * g + max(j for j in range(g) if (j * len(remote)) // g <= k)
                t["inter_in"][fetcher] += 1
                t["inter_out"][owner[p]] += 1
                for d in members:
                    if d != fetcher and p in need[d]:
                        t["intra_in"][d] += 1
                        t["intra_out"][fetcher] += 1
    return t


@pytest.mark.parametrize("cp,g", [(4, 2), (8, 2), (8, 4)])
@pytest.mark.parametrize("hierarchical", [True, False])
def test_two_level_traffic_equals_a_position_brute_force(cp, g, hierarchical):
    cm = CostModel.two_level(g, hierarchical=hierarchical)
    for seed in range(4):
        ids = _ids(60 + 13 * seed, seed, top=[6, 30, 60, 200][seed], hole=0.05)
        for name in ("contiguous", "zigzag", "balanced"):
            x = torch.nn.functional.pad(ids, (0, padded_length(ids.shape[1], name, cp) - ids.shape[1]))
            lay = build_layout(name, x, cp, cm)
            got = layout_traffic(lay.runs, [document_runs(x[0])], cm)
            want = _brute_traffic(x[0].tolist(), lay.positions.tolist(), g, hierarchical)
            for k, v in want.items():
                assert getattr(got, k).tolist() == v, (name, seed, k, getattr(got, k).tolist(), v)


def test_per_message_latency_by_hand():
    """Two nodes of two ranks, every rank fetching its own rows: rank 0 receives 5 positions from rank 1
    (its node) and 3 from rank 2 and 2 from rank 3 (the other node); rank 2 receives 4 from rank 0.
    Messages per link are the larger of a rank's non-empty incoming and outgoing transfers, paid
    forward and backward."""
    cm = CostModel(seconds_per_pair=1.0, seconds_per_position=1.0, seconds_per_position_inter=2.0,
                   ranks_per_node=2, seconds_per_message=10.0, seconds_per_message_inter=100.0)
    counts = torch.zeros(4, 4, dtype=torch.long)  # [src, dst]
    counts[1, 0], counts[2, 0], counts[3, 0], counts[0, 2] = 5, 3, 2, 4
    traffic = Traffic.from_counts(counts, ranks_per_node=2)
    assert traffic.intra_messages.tolist() == [1, 1, 0, 0]
    assert traffic.inter_messages.tolist() == [2, 0, 1, 1]  # rank 0: 2 in, 1 out; rank 2: 1 in, 1 out
    comm = cm.comm_seconds(traffic)
    # rank 0: NVLink 5 x 1 + IB max(5 in, 4 out) x 2 + 2 x (1 x 10 + 2 x 100) = 5 + 10 + 420
    assert comm[0].item() == pytest.approx(435)
    # rank 2: IB max(4 in, 3 out) x 2 + 2 x (1 x 100) = 208; rank 3: IB 2 out x 2 + 200 = 204
    assert comm[2].item() == pytest.approx(208) and comm[3].item() == pytest.approx(204)
    # rank 1: NVLink 5 out + 2 x 10
    assert comm[1].item() == pytest.approx(25)
    free = CostModel(seconds_per_pair=1.0, seconds_per_position=1.0, seconds_per_position_inter=2.0,
                     ranks_per_node=2)
    assert (comm - free.comm_seconds(traffic)).tolist() == pytest.approx([420, 20, 200, 200])


def test_overlap_follows_the_pipeline_by_hand():
    """Three ranks, one link (seconds_per_position 1 fwd+bwd: a chunk of n positions takes n/2 to
    fetch in forward). Rank 2: local compute 2, chunks from rank 1 (round 1) and rank 0 (round 2)."""
    cm = CostModel(seconds_per_pair=1.0, seconds_per_position=1.0)
    counts = torch.tensor([[0, 0, 8], [0, 0, 4], [0, 0, 0]])  # [src, dst]
    pair_work = torch.zeros(3, 3)
    pair_work[2, 2], pair_work[1, 2], pair_work[0, 2] = 14.0, 7.0, 14.0  # fwd 4/14 of each: 4, 2, 4
    traffic = Traffic.from_counts(counts)
    o = cm.overlapped(pair_work, traffic, counts, kv_backward="save")
    # rank 2 receives 12 positions: comm 12 (fwd + bwd), forward fetches share 6 by size: 2 (rank 1), 4 (rank 0).
    # forward: C0 = 4; chunk 1 (rank 1) arrives at 2: begin max(4, 2) = 4, T = 4 + 2 = 6; chunk 2
    # (rank 0) fetched from 4 to 8: begin max(6, 8) = 8, T = 8 + 4 = 12.
    # backward (save: the same fetch times, compute x 2.5): C0 = 10; chunk 1 ready at 2: T = 15;
    # chunk 2 fetched from 10 to 14: begin max(15, 14) = 15, T = 25.
    assert o.rank == 2 and o.modeled_seconds == pytest.approx(12 + 25)
    assert o.compute_seconds == pytest.approx(35) and o.exposed_seconds == pytest.approx(2)
    refetch = cm.overlapped(pair_work, traffic, counts, kv_backward="refetch")
    # backward fetches twice as long: chunk 1 ready at 4 (hidden), chunk 2 from 10 to 18: T = 18 + 10 = 28.
    assert refetch.modeled_seconds == pytest.approx(12 + 28)
    # Never more than no overlap (save), never less than the compute.
    assert o.modeled_seconds <= cm.modeled_seconds(pair_work.sum(0), traffic) + 1e-9


def test_one_shot_overlap_of_the_hierarchical_routes_by_hand():
    """Two nodes of two ranks: rank 3 receives 6 positions over IB (stage 1) and 4 over
    NVLink (stage 2); seconds_per_position 1 inside a node, 2 between (fwd + bwd), so one direction
    takes 6 (IB) and 2 (NVLink). Its local compute 14 (forward 4), remote 28 (forward 8)."""
    cm = CostModel(seconds_per_pair=1.0, seconds_per_position=1.0, seconds_per_position_inter=2.0,
                   ranks_per_node=2)
    z = torch.zeros(4, dtype=torch.long)
    traffic = Traffic(intra_in=torch.tensor([0, 0, 0, 4]), intra_out=z, inter_in=torch.tensor([0, 0, 0, 6]),
                      inter_out=z, intra_messages=z, inter_messages=z)
    pair_work = torch.zeros(4, 4)
    pair_work[3, 3], pair_work[0, 3] = 14.0, 28.0
    save = cm.overlapped(pair_work, traffic, torch.zeros(4, 4), kv_backward="save", one_shot=True)
    # forward: max(local 4, IB 6) + NVLink 2 + remote 8 = 16; backward (save): local 10 + remote 20
    # + the gradients home (6 + 2) = 38.
    assert save.rank == 3 and save.modeled_seconds == pytest.approx(16 + 38)
    assert save.compute_seconds == pytest.approx(42) and save.exposed_seconds == pytest.approx(12)
    refetch = cm.overlapped(pair_work, traffic, torch.zeros(4, 4), kv_backward="refetch", one_shot=True)
    # backward refetches: max(local 10, IB 6) + NVLink 2, then remote 20 and the gradients 8.
    assert refetch.modeled_seconds == pytest.approx(16 + 40)


def test_overlapped_model_matches_the_plan_and_stays_between_compute_and_no_overlap():
    ids = _ids(896, 3, top=300)
    for cm in (CostModel.preset("ib"), CostModel.two_level(4), CostModel.two_level(4, hierarchical=False)):
        for name in ("contiguous", "zigzag", "balanced"):
            lay = build_layout(name, ids, 8, cm)
            rows = [document_runs(ids[0])]
            work, dst, a, b = work_and_intervals(lay.runs, rows)
            pw = pair_work(lay.runs, rows)
            assert torch.equal(pw.sum(0), work)
            from megatron_ext.blockdiag_cp.intervals import overlap_counts

            counts = overlap_counts(lay.runs, dst, a, b)
            traffic = layout_traffic(lay.runs, rows, cm, intervals=(dst, a, b), counts=counts)
            save = cm.overlapped(pw, traffic, counts, kv_backward="save")
            assert save.modeled_seconds <= cm.modeled_seconds(work, traffic) * (1 + 1e-12)
            assert save.modeled_seconds >= float(work.max()) * cm.seconds_per_pair * (1 - 1e-12)
            assert cm.overlapped(pw, traffic, counts, "refetch").modeled_seconds >= save.modeled_seconds


def _chunk_layouts(S, cp, chunk):
    """Every layout of [0, S) in chunks of ``chunk`` tokens, S / cp tokens per rank: per rank, its
    positions (brute force)."""
    n, per = S // chunk, S // chunk // cp

    def rec(left, r):
        if r == cp:
            yield []
            return
        for combo in itertools.combinations(left, per):
            rest = [x for x in left if x not in combo]
            for tail in rec(rest, r + 1):
                yield [combo] + tail
    for assignment in rec(list(range(n)), 0):
        yield [[x * chunk + i for x in ch for i in range(chunk)] for ch in assignment]


def _brute_price(ids_row, positions, cm):
    """The two-level hierarchical model's modeled seconds, counted position by position."""
    g = cm.ranks_per_node
    start = [0] * len(ids_row)
    for p in range(1, len(ids_row)):
        start[p] = start[p - 1] if ids_row[p] == ids_row[p - 1] else p
    t = _brute_traffic(ids_row, positions, g, hierarchical=True)
    return max(sum(p - start[p] + 1 for p in row if ids_row[p] > 0) * cm.seconds_per_pair
               + max(t["intra_in"][r], t["intra_out"][r]) * cm.seconds_per_position
               + max(t["inter_in"][r], t["inter_out"][r]) * cm.seconds_per_position_inter
               for r, row in enumerate(positions))


@pytest.mark.parametrize("cp,g", [(4, 2), (8, 2), (8, 4)])
def test_node_exchange_ib_loads_equal_the_hierarchical_brute_force(cp, g):
    """What the per-node searches price on IB (``traffic.NodeExchange``): each rank's fetch window
    and the rows it sends to other nodes, against the position-by-position hierarchical count."""
    from megatron_ext.blockdiag_cp.layouts.balanced.traffic import NodeExchange, flatten
    from megatron_ext.blockdiag_cp.layouts.balanced.units import UnitTable

    S, chunk = 48, 3
    gen = torch.Generator().manual_seed(cp * 10 + g)
    for trial in range(12):
        x = _ids(S, 100 * g + trial, top=30, hole=0.1 if trial % 3 == 0 else 0.0)
        row = x[0].tolist()
        chunks = torch.randperm(S // chunk, generator=gen).view(cp, -1).tolist()
        positions = [sorted(c * chunk + i for c in mine for i in range(chunk)) for mine in chunks]
        owned = [[(c * chunk, (c + 1) * chunk) for c in sorted(mine)] for mine in chunks]
        want = _brute_traffic(row, positions, g, hierarchical=True)
        nodes = [[r for rank in owned[n * g:(n + 1) * g] for r in rank] for n in range(cp // g)]
        exchange = NodeExchange(UnitTable([document_runs(x[0])], S), nodes, g, q_inter=1.0)
        assert exchange.fetch.reshape(-1).tolist() == want["inter_in"], trial
        _, group, a, b = flatten([owned], cp)
        sent = exchange.sent_below(b.numpy()) - exchange.sent_below(a.numpy())
        got_out = torch.zeros(cp, dtype=torch.long).index_add_(0, group, torch.from_numpy(sent)).tolist()
        assert got_out == want["inter_out"], (trial, got_out, want["inter_out"])


def _tiny_ids(S, lengths):
    return torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))[:S].unsqueeze(0)


TINY_COST = dict(seconds_per_pair=1.0, seconds_per_position=0.5, name="tiny", ranks_per_node=2,
                 seconds_per_position_inter=4.0)


@pytest.mark.parametrize("S,chunk,cases", [(8, 1, 24), (32, 4, 40), (64, 8, 6)])
def test_node_aware_balanced_equals_a_brute_force_optimum_on_tiny_cases(S, chunk, cases):
    """cp 4 = 2 nodes x 2, IB 8x NVLink and a key as dear as half a query-key pair, documents of 1 to
    S / 2 tokens (each within a node's share): balanced's modeled time (counted position by position)
    is the least of every layout in ``chunk``-token chunks (2520 layouts: exhaustive at S = 8, where
    chunks are tokens; at S = 32 and 64 balanced cuts at any token, so it can also beat them, and
    does in most cases). Before the swaps between nodes (``layouts/balanced/nodes.py``), 8 of the
    first 120 cases at S = 32 came out above the optimum, up to 1.158x ([11, 9, 6, 6])."""
    cm = CostModel(**TINY_COST)
    layouts = list(_chunk_layouts(S, 4, chunk))
    assert len(layouts) == 2520
    g = torch.Generator().manual_seed(0)
    for case in range(cases):
        ids = _tiny_ids(S, torch.randint(1, S // 2 + 1, (S,), generator=g).tolist())
        row = ids[0].tolist()
        best = min(_brute_price(row, positions, cm) for positions in layouts)
        lay = build_layout("balanced", ids, 4, cm)
        got = _brute_price(row, lay.positions.tolist(), cm)
        rows = [document_runs(ids[0])]
        work, dst, a, b = work_and_intervals(lay.runs, rows)
        assert cm.modeled_seconds(work, layout_traffic(lay.runs, rows, cm)) == pytest.approx(got)
        lengths = torch.unique_consecutive(ids[0], return_counts=True)[1].tolist()
        assert got == best if chunk == 1 else got <= best, (case, lengths, got, best)


@pytest.mark.parametrize("lengths", [[11, 9, 6, 6], [11, 10, 11], [4, 2, 9, 15, 2], [16, 3, 8, 5], [8, 12, 6, 6]])
def test_node_swaps_reach_a_brute_force_optimum(lengths):
    """Cases the node-level search alone left 1.02-1.16x above the exhaustive 4-token optimum at
    S = 32: a document that fits a node's tokens but not its work, kept whole in one node. Trading
    a part of two nodes' spans (one document cut after its first tokens, another's tail moved) pays
    a few keys over IB for the balance."""
    cm = CostModel(**TINY_COST)
    ids = _tiny_ids(32, lengths)
    row = ids[0].tolist()
    best = min(_brute_price(row, positions, cm) for positions in _chunk_layouts(32, 4, 4))
    assert _brute_price(row, build_layout("balanced", ids, 4, cm).positions.tolist(), cm) <= best


def test_node_search_tries_a_striped_node():
    """Documents of 11, 5, 10 and 6 tokens at cp 4 = 2 x 2: each node's span starts with a document
    and ends inside the next, where its 2 ranks balance on chunks 0, 2 / 1, 3 of it (striped), not
    0, 3 / 1, 2 (zigzag); balanced does at least as well as the exhaustive 4-token search (44; it
    finds 43.5, cutting at single tokens; without the striped candidate 45)."""
    cm = CostModel(1.0, 0.5, "tiny", ranks_per_node=2, seconds_per_position_inter=4.0)
    ids = torch.repeat_interleave(torch.arange(1, 5), torch.tensor([11, 5, 10, 6])).unsqueeze(0)
    row = ids[0].tolist()
    best = min(_brute_price(row, positions, cm) for positions in _chunk_layouts(32, 4, 4))
    assert best == 44.0
    assert _brute_price(row, build_layout("balanced", ids, 4, cm).positions.tolist(), cm) <= best


def test_node_search_prices_the_rows_a_rank_sends_over_ib():
    """Documents of 11, 4, 9 and 8 tokens at cp 4 = 2 x 2: the node layout is {A, B, C's first token},
    {C, D}. A node's search that ignores IB leaves the token node 1 reads, and node 1's fetch, on ranks
    already busiest; priced, balanced reaches the optimum of the exhaustive 4-token search (44.5)."""
    cm = CostModel(1.0, 0.5, "tiny", ranks_per_node=2, seconds_per_position_inter=4.0)
    ids = torch.repeat_interleave(torch.arange(1, 5), torch.tensor([11, 4, 9, 8])).unsqueeze(0)
    row = ids[0].tolist()
    best = min(_brute_price(row, positions, cm) for positions in _chunk_layouts(32, 4, 4))
    assert best == 44.5
    assert _brute_price(row, build_layout("balanced", ids, 4, cm).positions.tolist(), cm) == best


def test_a_document_that_fits_a_node_stays_inside_it():
    """cp 16 = 2 nodes x 8: a document of a third of the sequence is split, but over one node's ranks."""
    S, cp = 8192, 16
    lengths = [300] * 9 + [S // 3] + [300] * 9
    lengths[-1] += S - sum(lengths)
    ids = torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths)).unsqueeze(0)
    cm = CostModel.two_level(8)
    lay = build_layout("balanced", ids, cp, cm)
    owner = lay.owner()
    big = owner[(ids[0] == 10)]
    holders = sorted(set(big.tolist()))
    assert len(holders) > 1 and len({r // 8 for r in holders}) == 1, holders
    traffic = layout_traffic(lay.runs, [document_runs(ids[0])], cm)
    flat_zigzag = layout_traffic(build_layout("zigzag", ids, cp).runs, [document_runs(ids[0])], cm)
    assert int(traffic.inter_in.sum()) < int(flat_zigzag.inter_in.sum())


def test_balanced_two_level_is_never_worse_than_contiguous_or_zigzag():
    g = torch.Generator().manual_seed(5)
    for cp, per_node in ((16, 8), (8, 2), (8, 4)):
        cm = CostModel.two_level(per_node)
        for _ in range(3):
            lengths = torch.exp(6 + 1.2 * torch.randn(60, generator=g)).long().clamp(1, 6000)
            ids = torch.repeat_interleave(torch.arange(1, 61), lengths)
            S = padded_length(ids.numel(), "zigzag", cp)
            ids = torch.nn.functional.pad(ids, (0, S - ids.numel())).unsqueeze(0)
            rows = [document_runs(ids[0])]
            got = {}
            for name in ("balanced", "contiguous", "zigzag"):
                runs = build_layout(name, ids, cp, cm).runs
                work, dst, a, b = work_and_intervals(runs, rows)
                got[name] = cm.modeled_seconds(work, layout_traffic(runs, rows, cm, intervals=(dst, a, b)))
            assert got["balanced"] <= min(got["contiguous"], got["zigzag"]) * (1 + 1e-9), got


def test_two_level_models_refuse_groups_that_are_not_whole_nodes():
    with pytest.raises(ValueError, match="does not split into nodes of 4 ranks"):
        build_layout("balanced", torch.ones(1, 60, dtype=torch.long), 6, CostModel.two_level(4))
    with pytest.raises(ValueError, match="ranks_per_node must be >= 1"):
        CostModel.two_level(0)
    with pytest.raises(ValueError, match="inter"):
        CostModel(1.0, 2.0, ranks_per_node=2, seconds_per_position_inter=1.0)
    cm = CostModel.two_level(8)
    assert cm.nodes(64) == 8 and cm.nodes(8) == 1 and not cm.spans_nodes(8)
    assert cm.seconds_per_position_inter == pytest.approx(8 * cm.seconds_per_position)
    # Everything that moves a balanced cut is in the agreement fact.
    keys = {CostModel.two_level(g, hierarchical=h).agreement_key() for g in (2, 4, 8) for h in (True, False)}
    assert len(keys) == 6 and CostModel.preset("ib").agreement_key() not in keys


# -- the launch: LOCAL_WORLD_SIZE=2 on 4 ranks is 2 nodes x 2 ----------------------------------------

pool4 = pool_fixture(4, env={"LOCAL_WORLD_SIZE": "2"})
S_GPT = 96


def launch_topology():
    import torch.distributed as dist

    from megatron_ext import parallel_state as ps
    from megatron_ext.blockdiag_cp import default_cost_model

    world = dist.group.WORLD
    pairs = dist.new_group([0, 2])  # one CP rank on each node
    rank = dist.get_rank()
    models = {x: default_cost_model(world, kv_exchange=x) for x in ("hierarchical", "a2a", "allgather", "halo")}
    return {"per_node": ps.cp_ranks_per_node(world), "spans": ps.cp_spans_nodes(world),
            "models": {x: (m.name, m.hierarchical) for x, m in models.items()},
            "pair_per_node": ps.cp_ranks_per_node(pairs) if rank in (0, 2) else None,
            "pair_model": default_cost_model(pairs, kv_exchange="hierarchical").hierarchical if rank in (0, 2)
            else None}


@pytest.mark.timeout(300)
def test_the_launch_gives_two_levels_pricing_the_exchange_in_use(pool4):
    for r in pool4.run(launch_topology):
        assert r["per_node"] == 2 and r["spans"]
        # A node's keys cross IB once only when the step routes them so; a2a / halo / all-gather
        # ranks each fetch their own.
        assert r["models"]["hierarchical"][0].startswith("2xnvlink+ib/hier") and r["models"]["hierarchical"][1]
        for x in ("a2a", "allgather", "halo"):
            name, hier = r["models"][x]
            assert name.startswith("2xnvlink+ib:") and not hier, (x, name)
    first = pool4.run(launch_topology)[0]
    assert first["pair_per_node"] == 1  # ranks 0 and 2: one per node
    assert first["pair_model"] is False  # hierarchical falls back to a2a there: priced as a2a


def gpt_step_on_two_nodes():
    import megatron_ext.blockdiag_cp as bdcp

    mpu = H.ensure_mpu(tp=1, cp=4)
    group = mpu.get_context_parallel_group()
    model = H.gpt_model(H.config(cp=4), _spec(), S_GPT)
    ref = H.reference_model({}, S_GPT)
    ref.load_state_dict(model.state_dict())
    out = {}
    for seed in (11, 12):
        batch = H.make_batch(S_GPT, 1, seed=seed)
        ref_loss, ref_grads = H.reference_loss_and_grads(ref, batch, bdcp.doc_ids_from_eod(batch["tokens"], H.EOD))
        for exchange in ("a2a", "allgather") if seed == 12 else ("hierarchical", "a2a"):
            loss_err, grad_err, state = H.cp_step_errors(model, batch, group, "balanced", exchange,
                                                         ref_loss, ref_grads)
            out[(seed, exchange)] = (loss_err, grad_err, state.report()["cost_model"])
    return out


def _spec():
    from megatron_ext.layers import get_gpt_layer_spec_with_blockdiag_cp

    return get_gpt_layer_spec_with_blockdiag_cp(use_te=False)


@pytest.mark.timeout(600)
def test_a_cp4_build_on_two_nodes_uses_the_two_level_model_and_trains_like_the_reference(pool4):
    for per_rank in pool4.run(gpt_step_on_two_nodes):
        for key, (loss_err, grad_err, model) in per_rank.items():
            # The default model prices the exchange the step runs (hierarchical routes only for it).
            want = "2xnvlink+ib/hier:" if key[1] == "hierarchical" else "2xnvlink+ib:"
            assert model.startswith(want), (key, model)
            assert loss_err < 1e-5 and grad_err < 1e-5, (key, loss_err, grad_err)


def test_a_node_search_counts_keys_from_other_nodes_and_sends_inside_the_node():
    """The per-node search's scorer: a rank receives every key of its documents it does not own
    (another node's too), and sends only to the search's own ranks."""
    from megatron_ext.blockdiag_cp.layouts.balanced.packing import split_and_pack
    from megatron_ext.blockdiag_cp.layouts.balanced.traffic import candidate_traffic, flatten
    from megatron_ext.blockdiag_cp.layouts.balanced.units import Units, UnitTable

    S, cp = 256, 2
    ids = _ids(S, 4, top=90)
    table = UnitTable([document_runs(ids[0])], S)
    spans = [(0, 40), (96, 160), (200, 224)]  # one node's share (128 tokens) of a larger group
    units = Units(table, spans, cp)
    owned = [o for theta in (1.0, 0.25) for o in split_and_pack(units, cp, theta, "zigzag")]
    n, group, a, b = flatten(owned, cp)
    work, need, sent = candidate_traffic(units, cp, n, group, a, b)
    row = ids[0].tolist()
    start = [0] * S
    for p in range(1, S):
        start[p] = start[p - 1] if row[p] == row[p - 1] else p
    for c, o in enumerate(owned):
        mine = [{p for x, y in spans_r for p in range(x, y)} for spans_r in o]
        assert sorted(p for m in mine for p in m) == [p for x, y in spans for p in range(x, y)]
        needed = [{k for p in m for k in range(start[p], p + 1)} - m for m in mine]
        assert need[c].tolist() == [len(x) for x in needed]
        assert sent[c].tolist() == [sum(len(needed[d] & mine[r]) for d in range(cp) if d != r) for r in range(cp)]
        assert work[c].tolist() == [sum(p - start[p] + 1 for p in m) for m in mine]
