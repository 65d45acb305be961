"""Equal-length range swaps (swaps.py) and their use inside the nodes of a two-level balanced layout."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from megatron_ext.blockdiag_cp.layouts.balanced import DEFAULT_TUNING, balanced_search
from megatron_ext.blockdiag_cp.cost import CostModel
from megatron_ext.blockdiag_cp.hierarchy import layout_traffic
from megatron_ext.blockdiag_cp.intervals import RankRuns, document_runs, work_and_intervals
from megatron_ext.blockdiag_cp.layouts import build_layout
from megatron_ext.blockdiag_cp.layouts.balanced.swaps import RangeSwaps, RangeWork


def _doc_ids(lengths, pad=0):
    ids = torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))
    return torch.nn.functional.pad(ids, (0, pad))


def _work_by_position(ids):
    """Causal pairs of each position (its place in its document, 1-based; padding 0)."""
    out, start = [], 0
    for p, d in enumerate(ids.tolist()):
        if p == 0 or d != ids[p - 1]:
            start = p
        out.append(p - start + 1 if d > 0 else 0)
    return np.array(out, dtype=np.float64)


def test_range_work_equals_a_position_count():
    g = torch.Generator().manual_seed(3)
    ids = _doc_ids(torch.randint(1, 40, (30,), generator=g).tolist(), pad=7)
    starts, _, doc = document_runs(ids)
    real = (doc > 0).double()
    work = RangeWork(starts.numpy(), real.numpy(), (real * (1 - starts).double()).numpy(), ids.numel())
    by_position = _work_by_position(ids)
    a = torch.randint(0, ids.numel(), (200,), generator=g).numpy()
    b = np.minimum(a + torch.randint(0, 90, (200,), generator=g).numpy(), ids.numel())
    want = np.array([by_position[x:y].sum() for x, y in zip(a, b)])
    assert np.array_equal(work.of(a, b), want)


def test_one_swap_by_hand():
    """Documents [0, 6) and [6, 8) over two ranks of 4 tokens. Rank 0 owns [2, 6): pairs 3+4+5+6 = 18;
    rank 1 owns [0, 2) and [6, 8): 1+2 + 1+2 = 6. Every swap moves 2 tokens (the shorter range); the
    best give rank 0's [2, 4) (7) for rank 1's [0, 2) (3) or [6, 8) (3), or its [4, 6) (11) for
    either: 14 and 10. Then nothing lowers 14 (nor, at 14, the 10), so the search stops."""
    ids = _doc_ids([6, 2])
    starts, _, doc = document_runs(ids)
    ones = torch.ones(starts.numel(), dtype=torch.float64)
    work = RangeWork(starts.numpy(), ones.numpy(), (1 - starts).double().numpy(), 8)
    by_position = _work_by_position(ids)
    scored = []

    def score(cands, pairs, base):
        scored.append(pairs)
        return np.array([[sum(by_position[a:b].sum() for a, b in spans) for spans in c] for c in cands])

    search = RangeSwaps([[(2, 6)], [(0, 2), (6, 8)]], score, work)
    assert search.total.tolist() == [18, 6] and scored == [None]
    assert search.step() and sorted(search.total.tolist()) == [10, 14]
    assert scored[1] == [(0, 1)]  # one peer: its best estimate only
    assert [sum(b - a for a, b in spans) for spans in search.owned] == [4, 4]
    assert sorted(p for spans in search.owned for a, b in spans for p in range(a, b)) == list(range(8))
    assert not search.step() and search.done and search.swaps == 1
    assert sorted(search.total.tolist()) == [10, 14]


def _modeled(ids, cp, cm, runs):
    rows = [document_runs(ids[0])]
    work, dst, a, b = work_and_intervals(runs, rows)
    return cm.modeled_seconds(work, layout_traffic(runs, rows, cm, intervals=(dst, a, b)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_swaps_keep_every_node_and_lower_the_modeled_time(seed):
    """cp 16 = 2 nodes x 8 at 16k tokens (lognormal, median 512): the swapped layout owns the same
    positions per node as the search's (a swap never crosses a node), equal tokens per rank, and is
    chosen only when the full model prices it below every other candidate."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(6.2 + 1.2 * torch.randn(200, generator=g)).long().clamp(1, 4000)
    ids = _doc_ids(lengths.tolist())[:16384].unsqueeze(0)
    cp, cm = 16, CostModel.two_level(8)
    swapped = build_layout("balanced", ids, cp, cm)
    choice = balanced_search(ids, cp, cm)
    label = choice.label
    assert torch.equal(RankRuns.build(cp, ids.shape[1], *choice.runs).start, swapped.runs.start)
    unswapped = balanced_search(ids, cp, cm, tuning=replace(DEFAULT_TUNING, node_swap_rounds=0))
    plain = RankRuns.build(cp, ids.shape[1], *unswapped.runs)
    assert label.endswith(" + swaps"), label  # these mixes are ones the swaps help
    assert unswapped.label == label[:-len(" + swaps")]  # the same search, not swapped
    assert swapped.positions.shape == plain.positions().shape == (cp, 16384 // cp)
    for node in range(2):
        rows = slice(8 * node, 8 * node + 8)
        assert sorted(swapped.positions[rows].flatten().tolist()) == sorted(plain.positions()[rows].flatten().tolist())
    assert _modeled(ids, cp, cm, swapped.runs) < _modeled(ids, cp, cm, plain)


def _two_node_score(ids, q_inter):
    """Brute-force node-level count of two nodes: causal pairs + q_inter * max(keys in, keys out)."""
    row = ids.tolist()
    start = [0] * len(row)
    for p in range(1, len(row)):
        start[p] = start[p - 1] if row[p] == row[p - 1] else p

    def score(cands, pairs, base):
        out = []
        for owned in cands:
            mine = [{p for a, b in spans for p in range(a, b)} for spans in owned]
            need = [{k for p in m for k in range(start[p], p + 1)} - m for m in mine]
            work = [sum(p - start[p] + 1 for p in m) for m in mine]
            out.append([work[n] + q_inter * max(len(need[n]), len(need[1 - n])) for n in range(2)])
        return np.array(out, dtype=np.float64)
    return score


def test_scoring_every_swap_finds_one_the_work_estimate_drops():
    """Documents of 11, 9, 6 and 6 tokens on two nodes of 16, keys 4x a pair: node-level contiguous
    scores 81 + 4*5 = 101 and 72 + 4*5 = 92 (B's first 5 tokens cross). Giving node 0's [12, 16) for
    node 1's [28, 32) (a part of each span: ``halvings``) moves 18 - 14 = 4 more pairs onto the busiest
    node, so the work estimate drops it; scored, it cuts B after its first token and D after its
    second: 85 + 4*2 = 93 and 68 + 4*2 = 76."""
    ids = _doc_ids([11, 9, 6, 6])
    starts, _, _ = document_runs(ids)
    ones = np.ones(starts.numel())
    work = RangeWork(starts.numpy(), ones, 1 - starts.double().numpy(), 32)
    score = _two_node_score(ids, 4.0)
    estimated = RangeSwaps([[(0, 16)], [(16, 32)]], score, work, halvings=True)
    assert estimated.total.tolist() == [101, 92]
    assert not estimated.step()  # every swap's estimate is above 101
    scored = RangeSwaps([[(0, 16)], [(16, 32)]], score, work, halvings=True, score_all=512)
    assert scored.step() and scored.owned == [[(0, 12), (28, 32)], [(12, 28)]]
    assert scored.total.tolist() == [93, 76]
    whole = RangeSwaps([[(0, 16)], [(16, 32)]], score, work, score_all=512)  # n = 16 only: the spans trade places
    assert not whole.step()
