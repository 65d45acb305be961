"""The planner's fast paths (issue 19, planning speed) equal the general code they skip: lookups
instead of binary searches, the numpy chunk split, the heavy-unit shortcut of the balanced search,
and the tables prepare_plan shares between the layout search, the plan and the route."""

import threading

import pytest
import torch

from megatron_ext.blockdiag_cp import chunks, intervals, prepare_plan
from megatron_ext.blockdiag_cp.layouts.balanced import balanced_search, search
from megatron_ext.blockdiag_cp.layouts.balanced.tuning import DEFAULT_TUNING
from megatron_ext.blockdiag_cp.layouts.balanced.units import Units, UnitTable
from megatron_ext.blockdiag_cp.cost import CostModel
from megatron_ext.blockdiag_cp.hierarchy import build_hierarchical_route
from megatron_ext.blockdiag_cp.intervals import clip, document_runs, map_ranges
from megatron_ext.blockdiag_cp.layouts import build_layout, padded_length
from megatron_ext.blockdiag_cp.plan import build_plan
from stream_reference import _split_at_chunks as split_at_chunks_in_torch  # the torch code the numpy split replaced


def _partition(P, n, g):
    cuts = torch.sort(torch.randperm(P - 1, generator=g)[:n - 1] + 1).values
    starts = torch.cat([torch.zeros(1, dtype=torch.long), cuts])
    return starts, torch.cat([cuts, torch.tensor([P])])


def _no_lookup(monkeypatch):
    monkeypatch.setattr(intervals, "_part_lookup", lambda *args: None)


def _random_runs(cp, L, g):
    """[0, cp * L) cut into random pieces dealt to ranks, L positions each: (owner [P], their runs)."""
    P = cp * L
    owner = torch.arange(cp).repeat_interleave(L)[torch.randperm(P, generator=g)]
    change = torch.ones(P, dtype=torch.bool)
    change[1:] = owner[1:] != owner[:-1]
    start = torch.nonzero(change).flatten()
    length = torch.cat([start[1:], torch.tensor([P])]) - start
    return owner, intervals.RankRuns.build(cp, P, owner[start], start, length)


@pytest.mark.parametrize("seed", range(4))
def test_clip_and_map_ranges_lookup_equal_searches(seed, monkeypatch):
    g = torch.Generator().manual_seed(seed)
    P = 600
    starts, ends = _partition(P, 7, g)
    a = torch.randint(0, P, (500,), generator=g)  # many ranges against few parts: the lookup path
    b = torch.minimum(a + torch.randint(1, 200, (500,), generator=g), torch.tensor(P))
    q_len = torch.where(torch.rand(500, generator=g) < 0.2, torch.zeros_like(a), b - a)
    value = torch.randint(0, 10_000, (starts.numel(),), generator=g)
    assert intervals._part_lookup(a, b, starts, ends) is not None
    fast = clip(a, b, starts, ends), map_ranges(starts, ends - starts, value, a, q_len)
    _no_lookup(monkeypatch)
    slow = clip(a, b, starts, ends), map_ranges(starts, ends - starts, value, a, q_len)
    for x, y in zip(fast, slow):
        assert all(torch.equal(u, v) for u, v in zip(x, y))


@pytest.mark.parametrize("high", [3, 40])
def test_repeat_arange_equals_numpys_repeat(high):
    """Both ways of ``repeat_arange`` (counts summed by a bincount for short repeats, numpy's repeat
    for long ones), zeros and an empty count included."""
    import numpy as np

    g = np.random.default_rng(high)
    for n in (0, 1, 7, 500):
        count = g.integers(0, high, n)
        if n > 1:
            count[0] = count[-1] = 0  # an index that never appears, first and last
        want = np.repeat(np.arange(n, dtype=np.int64), count)
        got = intervals.repeat_arange(count.astype(np.int64))
        assert got.dtype == np.int64 and np.array_equal(got, want), (n, count.tolist())


@pytest.mark.parametrize("seed", range(4))
def test_split_at_chunks_equals_reference(seed):
    g = torch.Generator().manual_seed(seed)
    cp, n = 4, 30
    src = torch.arange(cp).repeat_interleave(n)
    piece = torch.arange(n).repeat(cp)
    # Overlapping key ranges of one source (pieces of one document): the sort is needed.
    slot = torch.randint(0, 50, (cp * n,), generator=g)
    n_k = torch.randint(1, 40, (cp * n,), generator=g)
    got = chunks._split_at_chunks(src, slot, n_k, piece, 2, 8)
    want = split_at_chunks_in_torch(src, slot, n_k, piece, 2, 8)
    assert all(torch.equal(x, y) for x, y in zip(got, want))


def _ranges_in_order(seed, cp, n, long, long_len):
    """(src, slot, n_k, piece): per source n ascending key ranges of 0-5 keys, ``long`` of them
    ``long_len`` keys (over several chunks of 8); ``seed`` ranges moved back one key (an overlap:
    a sort needed)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.arange(cp).repeat_interleave(n)
    piece = torch.arange(n).repeat(cp)
    n_k = torch.randint(0, 6, (cp * n,), generator=g)
    n_k[torch.randint(0, cp * n, (long,), generator=g)] = long_len
    slot = torch.cat([torch.cumsum(x, 0) - x for x in n_k.view(cp, n)])
    slot[torch.randint(0, cp * n, (seed,), generator=g)] -= 1
    return src, slot.clamp(min=0), n_k, piece


@pytest.mark.parametrize("seed", range(4))
def test_split_at_chunks_in_order_equals_reference(seed):
    """Ascending, mostly disjoint key ranges (documents of a THD plan), a few over several chunks, some
    empty: the split's order check (per range, not per entry) must see whether a sort is needed."""
    src, slot, n_k, piece = _ranges_in_order(seed, 4, 30, long=3, long_len=17)
    got = chunks._split_at_chunks(src, slot, n_k, piece, 2, 8)
    want = split_at_chunks_in_torch(src, slot, n_k, piece, 2, 8)
    assert all(torch.equal(x, y) for x, y in zip(got, want))


@pytest.mark.parametrize("seed", range(3))
def test_split_at_chunks_many_ranges_equals_reference(seed):
    """Past the few thousand ranges where the split inserts the cut ranges' later pieces instead of
    expanding every range: mostly one-chunk ranges in order, some over several chunks, empty ones
    (one at a chunk's start: in no chunk), long own ranges; with seed > 0 an overlap needs the sort."""
    src, slot, n_k, piece = _ranges_in_order(seed, 4, 2500, long=40, long_len=30)
    assert src.numel() >= 1 << 13 and bool(((n_k == 0) & (slot % 8 == 0)).any())
    got = chunks._split_at_chunks(src, slot, n_k, piece, 2, 8)
    want = split_at_chunks_in_torch(src, slot, n_k, piece, 2, 8)
    assert all(torch.equal(x, y) for x, y in zip(got, want))


def test_heavy_units_are_what_light_rejects():
    """``heavy`` and ``next_heavy`` (the need split's lookup) reject exactly what ``light`` does."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 3000, (300,), generator=g).tolist() + [20_000, 9_000]
    ids = torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))[:2 ** 16]
    ids = torch.nn.functional.pad(ids, (0, 2 ** 16 - ids.numel()))
    table = UnitTable([document_runs(ids)], ids.numel())
    for cp in (4, 8):
        units = Units(table, [(0, ids.numel())], cp)
        L, target = units.tokens // cp, units.total / cp
        for theta in DEFAULT_TUNING.split_thresholds + (0.05, 0.0):
            limit = theta * target
            assert units.heavy(limit, L) == [i for i in units.by_work if not units.light(i, limit, L)]
            # From every position of the splittable order: the next unit light rejects there.
            order = units.splittable(L)[0]
            for k in range(0, len(order) + 1, 7):
                rest = [j for j, i in enumerate(order) if j >= k and not units.light(i, limit, L)]
                assert units.next_heavy(k, limit, L) == (rest[0] if rest else None)


def test_prepare_plan_shares_tables_without_changing_them():
    """The balanced search's pricing of its choice, the plan's intervals and the route's node routes,
    reused across one prepare_plan, equal what each computes alone."""
    g = torch.Generator().manual_seed(1)
    lengths = [int(x) for x in torch.randint(16, 900, (200,), generator=g)] + [6000]
    S, cp = 2 ** 15, 16
    ids = torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))[:S]
    cost = CostModel.two_level(8)
    prep = prepare_plan(ids, cp, cp - 1, layout="balanced", cost_model=cost, kinds=("needed",),
                        kv_exchange="hierarchical", ranks_per_node=8)
    # The search returns its tables with its choice: nothing of the call stays in the search's module.
    assert not [k for k, v in vars(search).items()
                if not k.startswith("__") and isinstance(v, (list, dict, set, threading.local))]
    padded = torch.nn.functional.pad(ids.unsqueeze(0), (0, padded_length(S, "balanced", cp) - S))
    assert prep.layout_choice == balanced_search(padded, cp, cost).label
    lay = build_layout("balanced", padded, cp, cost_model=cost)
    assert all(torch.equal(getattr(lay.runs, f), getattr(prep.layout.runs, f))
               for f in ("rank", "start", "length", "local"))
    plan = build_plan(padded, lay, cp - 1, kinds=("needed",))
    route = build_hierarchical_route(lay, padded, cp - 1, 8)
    for f in ("needed_remote", "work_per_rank"):
        assert torch.equal(getattr(plan, f), getattr(prep.plan, f))
    assert torch.equal(plan.exchange.counts, prep.plan.exchange.counts)
    assert all(torch.equal(x, y) for x, y in zip(plan.exchange.recv_positions, prep.plan.exchange.recv_positions))
    for f in route.__dataclass_fields__:
        x, y = getattr(route, f), getattr(prep.route, f)
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, f
    steps = plan.stream["needed"].steps
    assert [(s.source, s.first, s.chunk_len, len(s.calls)) for s in steps] == \
        [(s.source, s.first, s.chunk_len, len(s.calls)) for s in prep.plan.stream["needed"].steps]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "balanced", "thd"])
def test_halo_check_equals_the_sort_by_position(layout):
    from megatron_ext.blockdiag_cp.plan import _halo_check

    g = torch.Generator().manual_seed(3)
    cp = 4
    lengths = [int(x) for x in torch.randint(1, 300, (40,), generator=g)]
    if layout == "thd":
        lengths = [-(-n // (2 * cp)) * (2 * cp) for n in lengths]
    ids = torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths)).unsqueeze(0)
    ids = torch.nn.functional.pad(ids, (0, padded_length(ids.shape[1], layout, cp) - ids.shape[1]))
    lay = build_layout(layout, ids, cp)
    counts = build_plan(ids, lay, 0, kinds=()).exchange.counts
    owner = lay.runs.rank[lay.runs.by_position()[2]]
    adjacent = torch.zeros(cp, cp, dtype=torch.bool)
    adjacent[owner[1:], owner[:-1]] = True
    strays = (counts.t() > 0) & ~adjacent
    assert _halo_check(lay.runs, counts)[0] == (not bool(strays.any()))
    # and the reason names the same rank and sources where it fails
    for fake in (torch.ones(cp, cp, dtype=torch.long).fill_diagonal_(0),):
        strays = (fake.t() > 0) & ~adjacent
        ok, why = _halo_check(lay.runs, fake)
        assert ok == (not bool(strays.any()))
        if not ok:
            dst = int(torch.nonzero(strays.any(1)).flatten()[0])
            assert why.startswith(f"rank {dst} needs K/V from rank(s) {torch.nonzero(strays[dst]).flatten().tolist()}")


def test_the_search_hands_its_tables_only_to_its_own_thread():
    """A plan built ahead on a planning thread must never take the tables of a search on another:
    searches running on two threads at once each return the tables of their own layout."""
    g = torch.Generator().manual_seed(1)
    S, cp, cost = 2 ** 15, 16, CostModel.two_level(8)

    def padded_ids(lengths):
        ids = torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))[:S]
        return torch.nn.functional.pad(ids.unsqueeze(0), (0, padded_length(S, "balanced", cp) - ids.numel()))
    padded = padded_ids([int(x) for x in torch.randint(16, 900, (200,), generator=g)] + [6000])
    other_padded = padded_ids([int(x) for x in torch.randint(16, 300, (400,), generator=g)] + [9000])
    seen = []
    other = threading.Thread(target=lambda: seen.append(balanced_search(other_padded, cp, cost)))
    other.start()
    kept = balanced_search(padded, cp, cost)
    other.join()
    lay = build_layout("balanced", padded, cp, cost_model=cost)
    other_lay = build_layout("balanced", other_padded, cp, cost_model=cost)
    assert not torch.equal(lay.runs.start, other_lay.runs.start[:lay.runs.start.numel()])  # two layouts
    assert len(seen) == 1 and torch.equal(seen[0].tables.runs.start, other_lay.runs.start)
    assert kept.tables is not None and torch.equal(kept.tables.runs.start, lay.runs.start)
    # A later search on this thread gets its own tables, not those kept above.
    assert torch.equal(balanced_search(other_padded, cp, cost).tables.runs.start, other_lay.runs.start)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("n", [25, 20_000])  # one torch search, and a numpy search per source
def test_owned_ranges_equals_positions_brute_force(seed, n):
    """``intervals.owned_ranges`` (pieces read off flat_before's searches, with their sources) against
    every source's positions filtered one by one, and against ``map_ranges`` of the flat ranges (the
    code it replaced in the plan and the hierarchical route)."""
    g = torch.Generator().manual_seed(seed)
    cp, L = 4, 30
    P = cp * L
    _, runs = _random_runs(cp, L, g)
    a = torch.randint(0, P + 1, (n,), generator=g)
    b = torch.minimum(a + torch.randint(0, 40, (n,), generator=g), torch.tensor(P))
    skip = seed % cp
    lo, hi, src_out, start_out, len_out = intervals.owned_ranges(runs, a, b, skip)
    got = list(zip(torch.repeat_interleave(src_out, len_out).tolist(), intervals.ranges(start_out, len_out).tolist()))
    want = []
    for src in range(cp):
        pos = runs.positions(src).tolist()
        assert lo[src].tolist() == [src * L + sum(p < x for p in pos) for x in a.tolist()]
        assert hi[src].tolist() == [src * L + sum(p < x for p in pos) for x in b.tolist()]
        if src != skip:
            want += [(src, p) for x, y in zip(a.tolist(), b.tolist()) for p in pos if x <= p < y]
    assert got == want
    count = hi - lo
    count[skip] = 0
    _, ref_start, ref_len = map_ranges(runs.flat, runs.length, runs.start, lo.reshape(-1), count.reshape(-1))
    assert torch.equal(start_out, ref_start) and torch.equal(len_out, ref_len)


@pytest.mark.parametrize("name", ["thd", "contiguous", "zigzag"])
def test_interval_docs_and_flat_ranges_at_docs_equal_brute_force(name):
    """work_intervals_and_docs names each interval's document (one row, full attention) and
    flat_ranges read at those documents' starts equals counting every source's positions."""
    from megatron_ext.blockdiag_cp.intervals import flat_ranges, work_intervals_and_docs

    cp = 4
    g = torch.Generator().manual_seed(len(name))
    lengths = [1, 2 * cp, 5 * cp - 1] + torch.randint(1, 12 * cp, (12,), generator=g).tolist()
    parts = [torch.zeros(2 * cp, dtype=torch.long)]  # padding first: a document run with id 0
    for i, n in enumerate(lengths):
        ext = -(-n // (2 * cp)) * (2 * cp)
        parts += [torch.full((n,), i + 1), torch.zeros(ext - n, dtype=torch.long)]
    ids = torch.cat(parts)
    ids = torch.nn.functional.pad(ids, (0, -ids.numel() % (2 * cp)))
    runs = build_layout(name, ids.unsqueeze(0), cp).runs
    rows = [document_runs(ids)]
    work, dst, a, b, doc = work_intervals_and_docs(runs, rows)
    want = intervals.work_and_intervals(runs, rows)
    assert all(torch.equal(x, y) for x, y in zip((work, dst, a, b), want))
    starts, _, d_id = rows[0]
    assert torch.equal(starts[doc], a) and bool((d_id[doc] > 0).all())
    assert bool((ids[a] == d_id[doc]).all()) and bool((ids[b - 1] == d_id[doc]).all())
    owner = torch.empty(ids.numel(), dtype=torch.long)  # brute force: each position's owner and flat index
    flat = torch.empty(ids.numel(), dtype=torch.long)
    for r in range(cp):
        pos = runs.positions(r)
        owner[pos], flat[pos] = r, r * runs.local_len + torch.arange(pos.numel())
    for src in (None, 1):
        lo, hi = flat_ranges(runs, a, b, src, (starts, doc))
        assert torch.equal(lo, flat_ranges(runs, a, b, src)[0])
        for s in range(cp) if src is None else (src,):
            for j in range(a.numel()):
                mine = flat[a[j]:b[j]][owner[a[j]:b[j]] == s]
                before = int((owner[:a[j]] == s).sum())
                got_lo, got_hi = (lo[s, j], hi[s, j]) if src is None else (lo[j], hi[j])
                assert int(got_lo) == s * runs.local_len + before
                assert int(got_hi) - int(got_lo) == mine.numel()
    assert work_intervals_and_docs(runs, rows, window=3)[4] is None
    assert work_intervals_and_docs(runs, rows * 2)[4] is None


@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.parametrize("n", [40, 3_000])  # under and over overlap_counts' few-intervals threshold at cp 4
def test_overlap_counts_equals_a_position_count(n, shuffled):
    """``intervals.overlap_counts`` [src, dst]: positions src owns inside dst's intervals, on both of its
    paths (few intervals: searched and summed per dst; many: starts once per distinct start), for
    intervals sorted by dst as work_and_intervals gives them and not, against a count position by
    position."""
    g = torch.Generator().manual_seed(n + shuffled)
    cp, L = 4, 50
    P = cp * L
    owner, runs = _random_runs(cp, L, g)
    dst = torch.sort(torch.randint(0, cp, (n,), generator=g)).values
    a = torch.randint(0, 20, (n,), generator=g) * 10  # shared starts, as document starts are
    b = torch.minimum(a + torch.randint(1, 60, (n,), generator=g), torch.tensor(P))
    if shuffled:
        order = torch.randperm(n, generator=g)
        dst, a, b = dst[order], a[order], b[order]
    want = torch.zeros(cp, cp, dtype=torch.long)
    for d, x, y in zip(dst.tolist(), a.tolist(), b.tolist()):
        for src in owner[x:y].tolist():
            if src != d:
                want[src, d] += 1
    assert (n * cp < 1 << 13) == (n == 40)
    assert torch.equal(intervals.overlap_counts(runs, dst, a, b), want)
