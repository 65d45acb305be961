"""The balanced search's result (``layouts.balanced.BalancedChoice``) and its tuning.

The search returns what it chose (runs, label, the exact pricing's tables) instead of leaving it in
module state; prepare_plan and plan_summary report the label, and the tables are the layout's own,
counted again here by ``intervals.work_and_intervals`` and ``overlap_counts``.
"""

import dataclasses
import math

import pytest
import torch

from megatron_ext.blockdiag_cp import plan_summary, prepare_plan
from megatron_ext.blockdiag_cp.cost import CostModel
from megatron_ext.blockdiag_cp.intervals import RankRuns, document_runs, overlap_counts, work_and_intervals
from megatron_ext.blockdiag_cp.layouts import build_layout, padded_length
from megatron_ext.blockdiag_cp.layouts.balanced import (DEFAULT_TUNING, BalancedChoice, BalancedTuning,
                                                        balanced_runs, balanced_search)


def _padded(lengths, cp, rows=1):
    ids = torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))
    S = ids.numel()
    ids = torch.nn.functional.pad(ids, (0, padded_length(S, "balanced", cp) - S))
    return torch.stack([ids.roll(17 * r) for r in range(rows)]) if rows > 1 else ids.unsqueeze(0)


def _lengths(seed, n=120, top=900, heavy=3000):
    g = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.randint(16, top, (n,), generator=g)] + [heavy]


# (cost model, rows, whether the exact pricing keeps tables): one level without latency (the
# search's own choice), one level with a per-message latency, two levels hierarchical, two rows.
CASES = [("nvlink", 1, False), ("latency", 1, True), ("2lvl", 1, True), ("nvlink", 2, True)]


def _cost(name):
    if name == "latency":
        return CostModel.two_level(8, latency=3e-6, latency_inter=10e-6)
    return CostModel.two_level(8) if name == "2lvl" else CostModel.preset(name)


@pytest.mark.parametrize("cost_name,rows,priced", CASES)
def test_the_search_returns_its_choice_and_the_plan_reports_it(cost_name, rows, priced):
    cp = 16 if cost_name == "2lvl" else 4
    cost = _cost(cost_name)
    ids = _padded(_lengths(cp + rows), cp, rows)
    choice = balanced_search(ids, cp, cost)
    assert isinstance(choice, BalancedChoice) and choice.label
    with pytest.raises(dataclasses.FrozenInstanceError):
        choice.label = "other"
    assert all(torch.equal(x, y) for x, y in zip(choice.runs, balanced_runs(ids, cp, cost)))
    prep = prepare_plan(ids, cp, cp - 1, layout="balanced", cost_model=cost)
    runs = RankRuns.build(cp, ids.shape[1], *choice.runs)
    assert all(torch.equal(getattr(runs, f), getattr(prep.layout.runs, f)) for f in ("rank", "start", "length"))
    assert prep.layout_choice == choice.label
    assert plan_summary(ids, cp, layout="balanced", cost_model=cost)["layout_choice"] == choice.label
    assert (choice.tables is not None) == priced
    if priced:
        rows_runs = [document_runs(row) for row in ids]
        work, dst, a, b = work_and_intervals(prep.layout.runs, rows_runs)
        assert torch.equal(choice.tables.runs.start, prep.layout.runs.start)
        assert torch.equal(choice.tables.work, work)
        assert all(torch.equal(x, y) for x, y in zip(choice.tables.intervals, (dst, a, b)))
        assert torch.equal(choice.tables.counts, overlap_counts(prep.layout.runs, dst, a, b))
        assert (choice.tables.routes is not None) == (cost_name == "2lvl")
        assert choice.tables.ranks_per_node == cost.ranks_per_node


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "thd"])
def test_other_layouts_report_their_name(layout):
    ids = torch.repeat_interleave(torch.arange(1, 5), torch.tensor([8, 16, 24, 16]))
    assert prepare_plan(ids, 4, 0, layout=layout).layout_choice == layout
    assert prepare_plan(ids, 1, 0, layout="balanced").layout_choice == "balanced"  # one rank: no search


def test_a_tuning_steers_only_the_call_it_is_given_to():
    """Split thresholds of inf only (no "need" splits): every candidate left is contiguous, zigzag or
    a packing that splits nothing lighter than a rank's share; the default search, before and after,
    splits the heavy document at a finite threshold."""
    cp, cost = 4, CostModel.preset("nvlink")
    ids = _padded(_lengths(3, n=60, heavy=6000), cp)
    assert DEFAULT_TUNING == BalancedTuning()
    before = balanced_search(ids, cp, cost).label
    whole_only = dataclasses.replace(DEFAULT_TUNING, split_thresholds=(math.inf,), need_thresholds=())
    label = balanced_search(ids, cp, cost, tuning=whole_only).label
    assert label in {"contiguous", "zigzag", "zigzag@inf", "zigzag@inf/strict", "pack", "pack/strict"}, label
    assert before not in {"contiguous", "zigzag"} and "@inf" not in before, before
    assert balanced_search(ids, cp, cost).label == before
    assert build_layout("balanced", ids, cp, cost).name == "balanced"
