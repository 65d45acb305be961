"""The streamed plan's builder equals the one it replaced (tests/engine/stream_reference.py), field for field.

The builder was rewritten for speed (issue 19 item 4: slices of shared index tensors instead of
materializing every call's rows); the kernel calls, their order, index tensors, lengths and
windows must not change (``plan.build_plan`` then cuts a remote step's one call by its query rows' runs,
``chunks.with_calls_by_runs``). Random document ids with padding holes and all-padding ranks, one to
three rows, short and long documents, windows from 0 to past a
shard, every layout and cp 1-8, every rank and both chunk kinds.
"""

import pytest
import torch

from megatron_ext.blockdiag_cp.chunks import CHUNK_KINDS, build_stream_plan, with_calls_by_runs
from megatron_ext.blockdiag_cp.intervals import document_runs, overlap_counts, work_and_intervals
from megatron_ext.blockdiag_cp.layouts import build_layout, padded_length
from megatron_ext.blockdiag_cp.layouts.thd import thd_exchange_counts
from megatron_ext.blockdiag_cp.plan import build_plan
from stream_reference import reference_build_stream_plan


@pytest.fixture(autouse=True)
def _one_thread():
    # Hundreds of tiny tensor ops per plan: on a shared machine, a second intra-op thread turns each
    # into a wait for a busy core (10 ms per repeat_interleave under load instead of 20 us).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _random_ids(R, S, g, max_doc, hole, pad_tail):
    rows = []
    for _ in range(R):
        lengths = torch.randint(1, max_doc + 1, (S,), generator=g)
        ids = torch.repeat_interleave(torch.arange(1, S + 1), lengths)[:S]
        ids = torch.where(torch.rand(S, generator=g) < hole, torch.zeros_like(ids), ids)
        ids[S - pad_tail:] = 0  # whole ranks of padding when the tail is long
        rows.append(ids)
    return torch.stack(rows)


def _thd_ids(lengths, cp):
    parts = []
    for i, n in enumerate(lengths):  # each document padded at its end to a multiple of 2 * cp
        parts += [torch.full((n,), i + 1), torch.zeros(-(-n // (2 * cp)) * 2 * cp - n, dtype=torch.long)]
    return torch.cat(parts).unsqueeze(0)


def _assert_same(new, old, where):
    assert (new.kind, new.rank, new.cp, new.rows, new.local_len, new.chunk_rows) == \
        (old.kind, old.rank, old.cp, old.rows, old.local_len, old.chunk_rows), where
    assert len(new.steps) == len(old.steps), where
    for s, (a, b) in enumerate(zip(new.steps, old.steps)):
        assert (a.round, a.piece, a.source, a.first, a.chunk_len, len(a.calls)) == \
            (b.round, b.piece, b.source, b.first, b.chunk_len, len(b.calls)), (where, s)
        for c, (x, y) in enumerate(zip(a.calls, b.calls)):
            assert (x.causal, x.q_lens, x.k_lens, x.window) == (y.causal, y.q_lens, y.k_lens, y.window), \
                (where, s, c)
            assert x.q_index.dtype == y.q_index.dtype == x.k_index.dtype == torch.long, (where, s, c)
            assert torch.equal(x.q_index, y.q_index) and torch.equal(x.k_index, y.k_index), (where, s, c)


def _compare(ids, layout, cp, window, counters):
    lay = build_layout(layout, ids, cp)
    runs = lay.runs
    rows = [document_runs(ids[r]) for r in range(ids.shape[0])]
    _, dst, a, b = work_and_intervals(runs, rows, window)
    counts = (thd_exchange_counts(ids[0], cp) if layout == "thd" and window is None
              else overlap_counts(runs, dst, a, b))  # as build_plan counts
    for rank in range(cp):
        plan = build_plan(ids, lay, rank, window=window)  # the build's path (its tables passed in)
        for kind in CHUNK_KINDS:
            new = build_stream_plan(kind, runs, rows, rank, counts, (dst, a, b), window)
            old = reference_build_stream_plan(kind, runs, rows, rank, counts, (dst, a, b), window)
            _assert_same(new, old, (layout, cp, window, rank, kind, ids.shape))
            # the build cuts a remote step's one call by its query rows' runs (chunks.calls_by_runs)
            _assert_same(plan.stream[kind], with_calls_by_runs(old), (layout, cp, window, rank, kind, ids.shape,
                                                                       "build_plan"))
            counters["calls"] += sum(len(s.calls) for s in new.steps)
            if window is None:  # a window's banded calls are one per band edge (the kernels take one window)
                counters["most_calls_remote"] = max([counters["most_calls_remote"]] +
                                                    [len(s.calls) for s in new.steps[1:]])
                counters["most_calls_own"] = max(counters["most_calls_own"], len(new.steps[0].calls))
            counters["empty_rank"] += int(not new.steps[0].calls)


@pytest.mark.parametrize("seed", range(8))
def test_stream_plan_equals_the_reference_builder(seed):
    g = torch.Generator().manual_seed(100 + seed)
    counters = {"calls": 0, "most_calls_remote": 0, "most_calls_own": 0, "empty_rank": 0}
    for cp in range(1, 9):
        R = int(torch.randint(1, 4, (1,), generator=g))
        S = int(torch.randint(8, 40 * cp + 60, (1,), generator=g))
        max_doc = int(torch.randint(1, 2, (1,), generator=g)) if seed == 0 else int(
            torch.randint(2, 3 * S, (1,), generator=g))
        pad_tail = int(torch.randint(0, S // 2 + 1, (1,), generator=g)) if seed % 2 else 0
        window = [None, 0, 1, 3, 17, 100, None, 5][(seed + cp) % 8]
        for layout in ("contiguous", "zigzag", "balanced"):
            ids = _random_ids(R, S, g, max_doc, hole=0.05 * (seed % 3), pad_tail=pad_tail)
            ids = torch.nn.functional.pad(ids, (0, padded_length(S, layout, cp) - S))
            _compare(ids, layout, cp, window, counters)
        if cp > 1:
            ids = _thd_ids(torch.randint(1, 12 * cp, (int(torch.randint(1, 8, (1,), generator=g)),),
                                         generator=g).tolist(), cp)
            _compare(ids, "thd", cp, window, counters)
    # The cases reach ranks with no real query; without a window a received chunk costs at most two kernel
    # calls, and so do the local keys.
    assert counters["calls"] > 0
    assert counters["most_calls_remote"] <= 2 and counters["most_calls_own"] <= 2, counters
    if seed % 2:
        assert counters["empty_rank"] > 0, counters


def test_one_long_document_at_cp_8_equals_the_reference_builder():
    # The shape the rewrite is for: a document over every rank, whose every remote chunk all later rows see.
    ids = torch.ones(1, 8 * 64, dtype=torch.long)
    counters = {"calls": 0, "most_calls_remote": 0, "most_calls_own": 0, "empty_rank": 0}
    for layout in ("contiguous", "zigzag", "balanced"):
        for window in (None, 40, 200):
            _compare(ids, layout, 8, window, counters)
    assert counters["most_calls_remote"] <= 2 and counters["most_calls_own"] <= 2, counters
