"""The streamed plan (``chunks``) against a brute force: every (query, key) pair once.

For random and edge-case document ids, every layout, every rank and both chunk
kinds, the pairs the kernel calls of all steps cover -- reading each chunk
buffer as the transports deliver it (a source's whole local K/V for the ring,
``ExchangeTables.recv_positions`` for the needed-only steps) -- are exactly the
per-document causal pairs of this rank's queries, each exactly once; causal calls
are square diagonal blocks and full calls never see a key after a query.
"""

import pytest
import torch

from megatron_ext.blockdiag_cp.layouts import build_layout, padded_length
from megatron_ext.blockdiag_cp.plan import build_plan
from megatron_ext.testing.cases import CASES, make_doc_ids


def _expected_pairs(ids, positions, window=None):
    """{(row, query position, key position)} of per-document causal attention, position by position
    (with a window: keys [max(start, p - window), p])."""
    out = set()
    for row in range(ids.shape[0]):
        d = ids[row].tolist()
        start = list(range(len(d)))
        for p in range(1, len(d)):
            if d[p] == d[p - 1]:
                start[p] = start[p - 1]
        for p in positions.tolist():
            if d[p] > 0:
                first = start[p] if window is None else max(start[p], p - window)
                out |= {(row, p, k) for k in range(first, p + 1)}
    return out


def _covered_pairs(plan, lay, kind, R, window=None):
    mine = lay.runs.positions(plan.rank)
    got = []
    stream = plan.stream[kind]
    c = stream.chunk_rows
    for step in stream.steps:
        whole = (lay.runs.positions(step.source) if kind == "ring" or step.round == 0
                 else plan.exchange.recv_positions[step.source])
        chunk = whole[step.first:step.first + step.chunk_len]
        assert chunk.numel() == step.chunk_len, (kind, step)
        assert step.round == 0 or step.chunk_len <= c, (kind, step)  # a remote chunk is a piece of a shard
        assert step.round == 0 or all(not call.causal for call in step.calls)
        if step.round == 0 and window is None:
            assert len(step.calls) <= 2  # the earlier local pieces (full), the diagonal (causal)
        if step.round > 0 and window is None:  # a received chunk: at most two calls, each row once
            assert len(step.calls) <= 2, step
            assert sum(sum(call.q_lens) for call in step.calls) <= stream.local_len * R, step
        for call in step.calls:
            # The op merges a call's outputs into its query rows by index: a row twice in one call
            # would keep only one of its segments.
            assert call.q_index.unique().numel() == call.q_index.numel(), (kind, step, "a query row twice")
            if call.causal:
                assert call.q_lens == call.k_lens
            for qs, ks in zip(call.q_index.split(list(call.q_lens)), call.k_index.split(list(call.k_lens))):
                q_pos, k_pos = mine[qs // R], chunk[ks // R]
                assert bool((qs % R == qs[0] % R).all()) and bool((ks % R == qs[0] % R).all())
                nq, nk = len(qs), len(ks)
                if call.causal:
                    assert torch.equal(q_pos, k_pos)
                else:
                    assert int(k_pos.max()) < int(q_pos.min())  # every key precedes every query
                for i in range(nq):
                    hi = i + 1 if call.causal else nk
                    lo = 0 if call.window is None else max(0, i + nk - nq - call.window)
                    assert hi > lo, "a query row that sees no key of its segment"
                    got += [(int(qs[0]) % R, int(q_pos[i]), int(k_pos[j])) for j in range(lo, hi)]
    return got


def _check(ids, cp, layout, window=None):
    ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
    R = ids.shape[0]
    ids = torch.nn.functional.pad(ids, (0, padded_length(ids.shape[1], layout, cp) - ids.shape[1]))
    lay = build_layout(layout, ids, cp)
    for rank in range(cp):
        plan = build_plan(ids, lay, rank, window=window)
        want = _expected_pairs(ids, lay.runs.positions(rank), window)
        for kind in ("ring", "needed"):
            got = _covered_pairs(plan, lay, kind, R, window)
            assert len(got) == len(set(got)), (layout, cp, rank, kind, "a pair attended twice")
            assert set(got) == want, (layout, cp, rank, kind)
        # A chunk whose calls read each of its rows once has its gradient written, not summed. Without a
        # window and with one row of ids every needed key lies in one segment: every needed-only chunk is one
        for kind in ("ring", "needed"):
            for step in plan.stream[kind].steps[1:]:
                read = torch.cat([call.k_index for call in step.calls]) if step.calls else torch.zeros(0)
                once = bool(step.calls) and torch.equal(read.sort().values, torch.arange(step.chunk_len * R))
                assert step.reads_each_row_once(R) == once, (layout, cp, rank, kind, window)
                assert once or not step.calls or kind == "ring" or window is not None or R > 1, (layout, cp, rank)
        # The needed-only steps deliver exactly the remote keys some query needs: the lower bound.
        mine = set(lay.runs.positions(rank).tolist())
        remote = {k for _, _, k in want if k not in mine}
        assert sum(s.chunk_len for s in plan.stream["needed"].steps[1:]) == len(remote) == int(
            plan.needed_remote[rank]), (layout, cp, rank, window)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_steps_cover_every_pair_once(case, cp):
    for layout in ("contiguous", "zigzag", "balanced"):
        _check(make_doc_ids(case, 96, cp), cp, layout)


@pytest.mark.parametrize("case", ["single", "short", "len1_boundaries", "pad_middle", "b2"])
@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("window", [0, 1, 5, 23, 200])
def test_windowed_steps_cover_every_windowed_pair_once(case, cp, window):
    # Windows smaller than, equal to and larger than documents and shards, crossing rank boundaries.
    for layout in ("contiguous", "zigzag", "balanced"):
        _check(make_doc_ids(case, 96, cp), cp, layout, window)


def test_thd_layout_and_random_rows():
    g = torch.Generator().manual_seed(4)
    for cp in (2, 3):
        lengths = torch.randint(1, 20, (6,), generator=g).tolist()
        parts = []
        for i, n in enumerate(lengths):  # each document padded to a multiple of 2 * cp, as THD packs
            parts += [torch.full((n,), i + 1), torch.zeros(-(-n // (2 * cp)) * 2 * cp - n, dtype=torch.long)]
        for window in (None, 3, 7, 30):  # thd's two pieces per rank: a window sees both of a source's runs
            _check(torch.cat(parts), cp, "thd", window)
        rows = torch.stack([torch.repeat_interleave(torch.arange(1, 61), torch.randint(1, 9, (60,), generator=g))[:72]
                            for _ in range(3)])
        _check(rows, cp, "zigzag")


def test_zigzag_prefix_keys_are_gathered_once_per_chunk():
    # One document over cp = 4 zigzag: rank 3 holds chunks 3 and 4. From a source before chunk 3, both
    # of its pieces see the same keys: one segment, the keys gathered once (not once per piece).
    ids = torch.ones(1, 64, dtype=torch.long)
    lay = build_layout("zigzag", ids, 4)
    plan = build_plan(ids, lay, 3)
    ring = plan.stream["ring"]
    for step in ring.steps[1:]:
        for call in step.calls:
            assert call.k_index.numel() == call.k_index.unique().numel(), step
    assert max(int(c.k_index.numel()) for s in ring.steps[1:] for c in s.calls) <= ring.chunk_rows


def test_touching_pieces_of_a_document_attend_their_own_keys_in_one_causal_block():
    # One document over cp = 4 zigzag: rank r holds chunks r and 7 - r, which touch in its local storage
    # (the end of the first half, the start of the second). The own step is one causal call over both,
    # with no full call between them, so the second piece's rows take one output there, not a merge.
    # With a window the pieces stay apart (a window counts positions, not local rows).
    ids = torch.ones(1, 64, dtype=torch.long)
    lay = build_layout("zigzag", ids, 4)
    for rank in range(4):
        own = build_plan(ids, lay, rank).stream["needed"].steps[0].calls
        assert [(c.causal, c.q_lens) for c in own] == [(True, (16,))], rank
        if rank < 3:  # rank 3's chunks 3 and 4 are one run of positions: one piece either way
            own = build_plan(ids, lay, rank, window=40).stream["needed"].steps[0].calls
            assert own[-1].causal and own[-1].q_lens == (8, 8), rank
    # THD: every document's two chunks on a rank touch, so each is one block of the one causal call.
    ids = torch.repeat_interleave(torch.arange(1, 5), torch.tensor([16, 32, 8, 8])).unsqueeze(0)
    lay = build_layout("thd", ids, 4)
    for rank in range(4):
        own = build_plan(ids, lay, rank).stream["needed"].steps[0].calls
        assert [(c.causal, c.q_lens) for c in own] == [(True, (4, 8, 2, 2))], rank


def test_every_rank_walks_the_same_steps():
    # The transfers pair up only if every rank posts its steps in one order.
    ids = torch.cat([torch.ones(70, dtype=torch.long), torch.full((26,), 2)]).unsqueeze(0)
    for kind in ("ring", "needed"):
        for layout in ("contiguous", "zigzag", "balanced"):
            lay = build_layout(layout, ids, 4)
            orders = {tuple((s.round, s.piece) for s in build_plan(ids, lay, r).stream[kind].steps)
                      for r in range(4)}
            assert len(orders) == 1, (kind, layout)


def test_a_call_is_cut_at_a_break_of_its_query_rows_between_segments():
    """``calls_by_runs``: query rows in two runs whose break starts a segment become a call per run, each one
    run of rows, together the call's rows, keys and segments in order; a break inside a segment, more runs
    than ``RUN_CALLS``, one run, a causal call and a windowed one stay whole."""
    from megatron_ext.blockdiag_cp.chunks import RUN_CALLS, CallPlan, calls_by_runs

    def call(q, k, q_lens, k_lens, causal=False, window=None):
        return CallPlan(causal, torch.tensor(q), torch.tensor(k), q_lens, k_lens, window)

    two = call([0, 1, 2, 3, 10, 11, 12], [7, 8, 9, 3, 4], (4, 3), (3, 2))
    cut = calls_by_runs(two)
    assert [(c.q_index.tolist(), c.k_index.tolist(), c.q_lens, c.k_lens) for c in cut] == [
        ([0, 1, 2, 3], [7, 8, 9], (4,), (3,)), ([10, 11, 12], [3, 4], (3,), (2,))]
    assert not any(c.causal for c in cut) and all(c.window is None for c in cut)
    assert sum(c.pairs for c in cut) == two.pairs
    assert RUN_CALLS == 2
    for whole in (call([0, 1, 2, 3, 10, 11, 12], [7, 8, 9, 3, 4], (2, 5), (3, 2)),  # the break inside a segment
                  call([0, 1, 5, 6, 9], [1, 2, 3], (2, 2, 1), (1, 1, 1)),  # three runs
                  call([4, 5, 6, 7], [0, 1], (1, 3), (1, 1)),  # one run
                  call([0, 1, 5, 6], [0, 1, 5, 6], (2, 2), (2, 2), causal=True),
                  call([0, 1, 5, 6], [7, 8, 9, 3], (2, 2), (3, 1), window=4)):
        assert calls_by_runs(whole) == (whole,), whole
