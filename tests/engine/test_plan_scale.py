"""Issue 10: the interval planner equals the old one, plan_summary counts what it claims,
prepare_plan is the plan a real build uses, the cost model follows its formulas."""

import pytest
import torch

import megatron_ext.blockdiag_cp as bdcp
from megatron_ext.testing import WorkerPool
from megatron_ext.blockdiag_cp.cost import CostModel
from megatron_ext.blockdiag_cp.intervals import document_runs
from megatron_ext.blockdiag_cp.layouts import build_layout, padded_length
from megatron_ext.blockdiag_cp.plan import build_plan
from plan_reference import reference_build_plan


def _random_ids(R, S, g, hole=0.1, max_doc=40):
    rows = []
    for _ in range(R):
        lengths = torch.randint(1, max_doc, (S,), generator=g)
        ids = torch.repeat_interleave(torch.arange(1, S + 1), lengths)[:S]
        rows.append(torch.where(torch.rand(S, generator=g) < hole, torch.zeros_like(ids), ids))
    return torch.stack(rows)


def _thd_ids(lengths, cp):
    """Documents padded at their end to a multiple of 2*cp, as THD packs them."""
    parts = []
    for i, n in enumerate(lengths):
        ext = -(-n // (2 * cp)) * (2 * cp)
        parts += [torch.full((n,), i + 1), torch.zeros(ext - n, dtype=torch.long)]
    return torch.cat(parts).unsqueeze(0)


def _assert_same_plan(new, old):
    assert torch.equal(new.needed_remote, old["needed_remote"])
    assert torch.equal(new.work_per_rank, old["work_per_rank"])
    ex = old["exchange"]
    assert torch.equal(new.exchange.counts, ex["counts"])
    assert len(new.exchange.send_index) == len(ex["send_index"])
    assert all(torch.equal(a, b) for a, b in zip(new.exchange.send_index, ex["send_index"]))
    assert all(torch.equal(a, b) for a, b in zip(new.exchange.recv_positions, ex["recv_positions"]))
    assert (new.exchange.halo_ok, new.exchange.halo_reason) == (ex["halo_ok"], ex["halo_reason"])


@pytest.mark.parametrize("seed", range(6))
def test_interval_plan_equals_the_old_planner(seed):
    g = torch.Generator().manual_seed(seed)
    for R, cp in ((1, 2), (1, 3), (2, 4), (3, 8), (1, 8), (1, 1)):
        S = int(torch.randint(5, 260, (1,), generator=g))
        for name in ("contiguous", "zigzag", "balanced"):
            ids = _random_ids(R, S, g)
            ids = torch.nn.functional.pad(ids, (0, padded_length(S, name, cp) - S))
            lay = build_layout(name, ids, cp)
            for rank in range(cp):
                _assert_same_plan(build_plan(ids, lay, rank), reference_build_plan(ids, lay, rank))
        if R == 1 and cp > 1:
            ids = _thd_ids(torch.randint(1, 30, (7,), generator=g).tolist(), cp)
            lay = build_layout("thd", ids, cp)
            for rank in range(cp):
                _assert_same_plan(build_plan(ids, lay, rank), reference_build_plan(ids, lay, rank))


def test_lazy_rounds_build_only_what_is_asked():
    ids = _random_ids(1, 200, torch.Generator().manual_seed(3))
    plan = build_plan(ids, build_layout("contiguous", ids, 4), 1, kinds=("needed",))
    assert list(plan.stream._built) == ["needed"]
    assert plan.stream["ring"].steps[0].round == 0 and set(plan.stream) == {"ring", "needed"}
    with pytest.raises(KeyError, match="unknown chunk kind"):
        plan.stream["sparse"]


def _brute_force(ids_row, positions):
    """Per rank: causal pairs, remote keys needed and own keys other ranks need (sent), position by
    position from the doc ids."""
    P = len(ids_row)
    start = [0] * P
    for p in range(1, P):
        start[p] = start[p - 1] if ids_row[p] == ids_row[p - 1] else p
    owner = {p: r for r, row in enumerate(positions.tolist()) for p in row}
    work, need, sent = [], [], [0] * len(positions)
    for row in positions.tolist():
        mine, needed, w = set(row), set(), 0
        for p in row:
            if ids_row[p] > 0:
                w += p - start[p] + 1
                needed.update(range(start[p], p + 1))
        work.append(w)
        need.append(len(needed - mine))
        for p in needed - mine:
            sent[owner[p]] += 1
    return work, need, sent


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "balanced", "thd"])
@pytest.mark.parametrize("link", ["nvlink", "ib"])
def test_plan_summary_counts_equal_a_brute_force_count_from_its_positions(layout, link):
    g = torch.Generator().manual_seed(11)
    cp = 4
    if layout == "thd":
        ids = _thd_ids(torch.randint(1, 90, (9,), generator=g).tolist(), cp)[0]
    else:
        ids = _random_ids(1, 700, g, max_doc=160)[0]
    summary = bdcp.plan_summary(ids, cp, layout=layout, cost_model=CostModel.preset(link))
    positions = summary["positions"]
    P = summary["padded_len"]
    assert positions.shape == (cp, P // cp) and sorted(positions.flatten().tolist()) == list(range(P))
    padded = torch.nn.functional.pad(ids, (0, P - ids.numel())).tolist()
    work, need, sent = _brute_force(padded, positions)
    assert summary["work_per_rank"] == work
    assert summary["needed_positions_per_rank"] == need
    assert summary["traffic"].intra_in.tolist() == need and summary["traffic"].intra_out.tolist() == sent
    assert summary["allgather_positions_per_rank"] == [(cp - 1) * P // cp] * cp
    cm = CostModel.preset(link)
    # One link, full duplex: a rank's exchange takes the larger of what it receives and what it sends.
    modeled = max(w * cm.seconds_per_pair + max(n, o) * cm.seconds_per_position
                  for w, n, o in zip(work, need, sent))
    assert summary["modeled_seconds"] == pytest.approx(modeled, rel=1e-12)
    assert summary["ideal_seconds"] == pytest.approx(sum(work) / cp * cm.seconds_per_pair, rel=1e-12)
    assert summary["ideal_seconds"] <= summary["lower_bound_seconds"] * (1 + 1e-12)
    assert summary["lower_bound_seconds"] <= summary["modeled_seconds"] * (1 + 1e-12)
    assert summary["plan_seconds"] > 0


def test_balanced_is_never_worse_than_contiguous_or_zigzag_under_its_cost_model():
    g = torch.Generator().manual_seed(5)
    for link in ("nvlink", "ib"):
        cm = CostModel.preset(link)
        for _ in range(3):
            lengths = torch.exp(6 + 1.2 * torch.randn(40, generator=g)).long().clamp(1, 4000)
            ids = torch.repeat_interleave(torch.arange(1, 41), lengths)
            got = {lay: bdcp.plan_summary(ids, 8, lay, cm)["modeled_seconds"]
                   for lay in ("balanced", "contiguous", "zigzag")}
            assert got["balanced"] <= min(got["contiguous"], got["zigzag"]) * (1 + 1e-9), got


def test_cost_model_presets_follow_the_formulas():
    cm = CostModel.preset("ib", heads=32, kv_heads=8, head_dim=128)
    assert cm.seconds_per_pair == pytest.approx(14 * 32 * 128 / 500e12)
    assert cm.seconds_per_position == pytest.approx(2 * (2 * 8 * 128 * 2) / 50e9)
    assert CostModel.preset("nvlink").seconds_per_position == pytest.approx(2 * (2 * 8 * 128 * 2) / 400e9)
    assert bdcp.default_cost_model().name.startswith("nvlink")  # no process group: one node
    with pytest.raises(ValueError, match="unknown link"):
        CostModel.preset("ethernet")


def test_cp1_build_uses_the_prepared_plan():
    ids = _random_ids(2, 90, torch.Generator().manual_seed(2))
    prep = bdcp.prepare_plan(ids, 1, 0, layout="zigzag")
    state = bdcp.BlockDiagCPState.build(ids, layout="zigzag", attn_backend="dense", prepared=prep)
    assert state.plan is prep.plan and state.layout is prep.layout
    inline = bdcp.BlockDiagCPState.build(ids, layout="zigzag", attn_backend="dense")
    assert torch.equal(inline.layout.positions, prep.layout.positions)
    s, o = inline.plan.stream["needed"].steps[0].calls, prep.plan.stream["needed"].steps[0].calls
    assert [(c.causal, c.q_lens, c.k_lens) for c in s] == [(c.causal, c.q_lens, c.k_lens) for c in o]
    assert all(torch.equal(a.k_index, b.k_index) for a, b in zip(s, o))
    # A plan prepared for other ids is not used: the build plans in line.
    other = bdcp.BlockDiagCPState.build(ids.flip(-1), layout="zigzag", attn_backend="dense", prepared=prep)
    assert other.plan is not prep.plan


def _build_with_and_without_prepared(layout, exchange):
    import megatron_ext.blockdiag_cp as bdcp

    cp, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    ids = _random_ids(1, 301, torch.Generator().manual_seed(9), max_doc=80)[0]
    prep = bdcp.prepare_plan(ids, cp, rank, layout=layout, kinds=("needed",))
    built = bdcp.BlockDiagCPState.build(ids, layout=layout, kv_exchange=exchange, attn_backend="dense",
                                        prepared=prep)
    inline = bdcp.BlockDiagCPState.build(ids, layout=layout, kv_exchange=exchange, attn_backend="dense")
    summary = bdcp.plan_summary(ids, cp, layout=layout, rank=rank)
    a, b = inline.plan, prep.plan
    return {
        "prepared_used": built.plan is prep.plan,
        "positions": torch.equal(inline.layout.positions, summary["positions"]),
        "counts": torch.equal(a.exchange.counts, b.exchange.counts),
        "send": all(torch.equal(x, y) for x, y in zip(a.exchange.send_index, b.exchange.send_index)),
        "recv": all(torch.equal(x, y) for x, y in zip(a.exchange.recv_positions, b.exchange.recv_positions)),
        "segments": all(torch.equal(x.k_index, y.k_index) for ra, rb in zip(
            a.stream["needed"].steps, b.stream["needed"].steps) for x, y in zip(ra.calls, rb.calls)),
        "needed": a.needed_remote.tolist() == summary["needed_positions_per_rank"],
        "work": a.work_per_rank.tolist() == summary["work_per_rank"],
    }


@pytest.mark.timeout(120)
def test_gloo_build_uses_the_same_plan_as_prepare_plan_and_plan_summary():
    pool = WorkerPool(2)
    try:
        for layout in ("balanced", "zigzag"):
            for per_rank in pool.run(_build_with_and_without_prepared, layout, "a2a"):
                assert all(per_rank.values()), (layout, per_rank)
    finally:
        pool.close()


def test_planner_cli_on_a_tiny_indexed_dataset(tmp_path, capsys):
    from megatron_ext.training.data import write_indexed_dataset

    from megatron_ext.plan.__main__ import main, sample_sequences

    g = torch.Generator().manual_seed(4)
    files = []
    for i, n in enumerate(torch.randint(5, 700, (30,), generator=g).tolist()):
        f = tmp_path / f"doc{i}.txt"
        f.write_bytes(bytes(torch.randint(0, 256, (n,), generator=g).tolist()))
        files.append(f)
    prefix = str(tmp_path / "tiny")
    write_indexed_dataset(files, prefix, progress=False)
    png = tmp_path / "plan.png"
    assert main(["--data-path", prefix, "--seq-length", "2048", "--cp", "4", "--link", "ib",
                 "--samples", "1", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert png.exists() and png.stat().st_size > 0
    # The printed K/V bytes of the needed-only exchange equal plan_summary on the same sample.
    tokens = next(sample_sequences(prefix, 2048, 1, 0))
    assert tokens.shape == (2048,)
    ids = bdcp.doc_ids_from_eod(torch.from_numpy(tokens).unsqueeze(0), 256)[0]
    for layout in ("contiguous", "zigzag", "balanced"):
        s = bdcp.plan_summary(ids, 4, layout=layout, cost_model=CostModel.preset("ib"))
        mib = max(s["needed_positions_per_rank"]) * 2 * 8 * 128 * 2 / 2**20
        line = next(l for l in out.splitlines() if l.split()[:2] == [layout, "a2a"])
        assert float(line.split()[2]) == pytest.approx(mib, abs=0.006), line
    with pytest.raises(SystemExit):
        main(["--data-path", str(tmp_path / "missing"), "--seq-length", "8", "--cp", "2"])


def test_rank_runs_merge_touching_ranges_and_build_only_the_asked_rank():
    from megatron_ext.blockdiag_cp.intervals import RankRuns

    # rank 0 owns [0, 2) + [2, 4) (touching: one run) + [8, 10); rank 1 owns [4, 8) + [10, 12)
    runs = RankRuns.build(2, 12, torch.tensor([1, 0, 0, 1, 0]), torch.tensor([10, 2, 0, 4, 8]),
                          torch.tensor([2, 2, 2, 4, 2]))
    assert runs.start.tolist() == [0, 8, 4, 10] and runs.length.tolist() == [4, 2, 4, 2]
    assert runs.positions().tolist() == [[0, 1, 2, 3, 8, 9], [4, 5, 6, 7, 10, 11]]
    assert runs.positions(1).tolist() == [4, 5, 6, 7, 10, 11]
    # flat_before: src's first flat index at or after x (src * L + its positions below x)
    assert runs.flat_before(torch.tensor([0, 5, 9, 12])).tolist() == [[0, 4, 5, 6], [6, 7, 10, 12]]
    with pytest.raises(ValueError, match=r"ranks own \[4, 8\] positions, expected 6"):
        RankRuns.build(2, 12, torch.tensor([0, 1]), torch.tensor([0, 4]), torch.tensor([4, 8]))
    lay = build_layout("zigzag", torch.ones(1, 16, dtype=torch.long), 4)
    assert "positions" not in lay.__dict__  # nothing built yet
    assert lay.rank_positions(3).tolist() == [6, 7, 8, 9] and "positions" not in lay.__dict__
    assert lay.positions[3].tolist() == [6, 7, 8, 9]


def _heavy_ids(g, S, heavy):
    lengths = torch.exp(4 + 1.2 * torch.randn(S, generator=g)).long().clamp(1, S)
    lengths = torch.cat([lengths[:3], torch.tensor([heavy]), lengths[3:]])
    ids = torch.repeat_interleave(torch.arange(1, lengths.numel() + 1), lengths)[:S]
    return ids


def test_balanced_candidates_count_like_the_plan():
    """The batched candidate scorer equals a position-by-position count, for every candidate kind."""
    from megatron_ext.blockdiag_cp.layouts.balanced.packing import split_and_pack
    from megatron_ext.blockdiag_cp.layouts.balanced.traffic import candidate_traffic, flatten
    from megatron_ext.blockdiag_cp.layouts.balanced.units import Units, UnitTable

    g = torch.Generator().manual_seed(17)
    cp, S = 4, 640
    ids = _heavy_ids(g, S, 300).unsqueeze(0)
    units = Units(UnitTable([document_runs(ids[0])], S), [(0, S)], cp)
    owned = [o for theta in (1.0, 0.5, 0.25) for style in ("zigzag", "need")
             for o in split_and_pack(units, cp, theta, style)]
    n, group, a, b = flatten(owned, cp)
    work, need, sent = candidate_traffic(units, cp, n, group, a, b)
    for c, o in enumerate(owned):
        positions = torch.stack([torch.cat([torch.arange(x, y) for x, y in sorted(spans)]) for spans in o])
        assert sorted(positions.flatten().tolist()) == list(range(S))  # equal tokens, a partition
        want_work, want_need, want_sent = _brute_force(ids[0].tolist(), positions)
        assert work[c].tolist() == want_work and need[c].tolist() == want_need, c
        assert sent[c].tolist() == want_sent, c


@pytest.mark.parametrize("seed", range(3))
def test_balanced_lockstep_packing_equals_one_packing_at_a_time(seed):
    """Steps 2-3 of many packings in lockstep (numpy) hold exactly the ranges, in the same order, that
    the one-at-a-time Python packing does, for span sets of different sizes at every threshold."""
    from megatron_ext.blockdiag_cp.layouts.balanced.packing import pack, pack_lockstep, split_heavy
    from megatron_ext.blockdiag_cp.layouts.balanced.tuning import DEFAULT_TUNING
    from megatron_ext.blockdiag_cp.layouts.balanced.units import Units, UnitTable

    g = torch.Generator().manual_seed(seed)
    cp, S = 4, 4096
    ids = _heavy_ids(g, S, 900).unsqueeze(0)
    table = UnitTable([document_runs(ids[0])], S)
    cuts = [0, 640, 1024, 2048, 2560, S]  # node-like span sets with different unit counts
    jobs = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        units = Units(table, [(a, b)], cp)
        seen = set()
        for style, thetas in (("zigzag", DEFAULT_TUNING.node_thresholds), ("need", (0.5, 0.25))):
            for theta in thetas:
                split = split_heavy(units, cp, theta, style, seen)
                if split is not None:
                    jobs.append((units, *split))
    assert len({len(whole) for *_, whole in jobs}) > 1  # packings of different lengths step together
    packed = pack_lockstep(jobs, cp)
    for (units, ranks, whole), flats in zip(jobs, packed):
        for flat, owned in zip(flats, pack(units, ranks.copy(), whole)):
            got = [[] for _ in range(cp)]
            for r, a, b in zip(*(x.tolist() for x in flat)):
                got[r].append((a, b))
            assert got == owned


@pytest.mark.parametrize("seed", range(3))
def test_balanced_over_ib_with_a_heavy_document_plans_like_the_old_planner(seed):
    """Layouts that split a long document over several ranks plan exactly right."""
    g = torch.Generator().manual_seed(seed)
    cp, S = 4, 512
    ids = _heavy_ids(g, S, 256).unsqueeze(0)
    for link in ("nvlink", "ib"):
        cm = CostModel.preset(link)
        lay = build_layout("balanced", ids, cp, cost_model=cm)
        for rank in range(cp):
            _assert_same_plan(build_plan(ids, lay, rank), reference_build_plan(ids, lay, rank))
        got = {name: bdcp.plan_summary(ids[0], cp, name, cm)["modeled_seconds"]
               for name in ("balanced", "contiguous", "zigzag")}
        assert got["balanced"] <= min(got["contiguous"], got["zigzag"]) * (1 + 1e-9), got


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "balanced", "thd"])
def test_both_ends_of_a_pair_agree_on_whether_it_moves_a_run(layout):
    # NeededTransport sends a run planar and its destination posts a planar receive: each decides from its
    # own plan tables (PairRuns), so for every pair the sender's answer must be the receiver's, and a run
    # must be exactly the rows the send index lists. Several doc-id rows (R = 2), a window, one document.
    from megatron_ext.blockdiag_cp.plan import PairRuns

    g = torch.Generator().manual_seed(5)
    cp = 4
    cases = [(_random_ids(1, 700, g, max_doc=160), None), (_random_ids(2, 640, g, max_doc=90), None),
             (_random_ids(1, 700, g, max_doc=160), 50), (torch.ones(1, 512, dtype=torch.long), None)]
    if layout == "thd":
        cases = [(_thd_ids(torch.randint(1, 90, (9,), generator=g).tolist(), cp), None),
                 (_thd_ids([300, 20, 44], cp), 40), (_thd_ids([512], cp), None)]
    seen_run = seen_scattered = 0
    for ids, window in cases:
        P = padded_length(ids.shape[-1], layout, cp)
        ids = torch.nn.functional.pad(ids, (0, P - ids.shape[-1]))
        lay = build_layout(layout, ids, cp)
        plans = [build_plan(ids, lay, r, kinds=(), window=window) for r in range(cp)]
        runs = [PairRuns.of(p, lay.runs) for p in plans]
        for src in range(cp):
            for dst in range(cp):
                index = plans[src].exchange.send_index[dst]
                start = runs[src].sent_from[dst]
                assert (start is not None) == runs[dst].received_run[src], (ids.shape, window, src, dst)
                if start is not None:
                    assert torch.equal(index, torch.arange(start, start + index.numel()))
                    seen_run += 1
                elif src != dst and index.numel():
                    assert not torch.equal(index, torch.arange(int(index[0]), int(index[0]) + index.numel()))
                    seen_scattered += 1
    assert seen_run and (seen_scattered or layout != "thd"), (seen_run, seen_scattered)  # thd: scattered too
