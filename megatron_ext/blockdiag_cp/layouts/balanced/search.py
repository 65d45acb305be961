"""The balanced search's entry: equal tokens per rank, the least modeled time it finds.

``balanced_search(ids, cp, cost_model)`` lays the padded sequence out in three steps and returns
its choice (``BalancedChoice``: the runs, the chosen candidate's label and what the exact pricing
computed for it, which the plan reuses); ``balanced_runs`` is its runs alone.

1. Candidates, scored on document runs alone (``candidates``): contiguous and
   zigzag themselves, and split-and-pack layouts (``packing``: documents heavier
   than a threshold of a rank's work share split over a few ranks, the rest
   packed whole and cut at multiples of the local length), each scored by its
   busiest rank's work plus ``q`` times the larger of the K/V positions it
   receives and sends (``traffic``).
2. Two levels (a cost model whose group spans nodes, ``nodes``): the same search
   over nodes first, then inside every node over its ranks, plus equal-length
   range swaps inside and between nodes (``swaps``).
3. The finalists and the flat contiguous and zigzag layouts priced exactly with
   the full model (``hierarchy.needed_traffic``), which picks; one level without
   per-message latency takes the search's own choice (``candidates.choose``).

The constants that steer it are in ``tuning``; the design and its reasons are in
docs/design/balanced_search.md.
"""

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from ...cost import CostModel, WindowMix
from ...intervals import DocRuns, RankRuns, document_runs, overlap_counts, work_and_intervals
from ..base import RunSpec
from .candidates import choose, find_candidates
from .nodes import node_finalists
from .traffic import candidate_traffic, flatten, runs_of
from .tuning import DEFAULT_TUNING, BalancedTuning
from .units import Owned, Spans, UnitTable

if TYPE_CHECKING:  # imported at run time by the exact pricing only
    from ...hierarchy import NodeRoutes


class ChosenTables(NamedTuple):
    """What the exact pricing computed for the layout it chose (full attention), which that layout's
    plan and two-level routes would compute again."""

    runs: RankRuns
    work: torch.Tensor  # [cp] query-key pairs per rank
    intervals: Tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (dst, a, b): the needed K/V ranges
    counts: torch.Tensor  # [cp, cp] needed positions, source by destination (``intervals.overlap_counts``)
    routes: Optional["NodeRoutes"]  # ``hierarchy.needed_traffic``'s (None: not a two-level hierarchical model)
    ranks_per_node: int  # the cost model's, which the routes are for


@dataclass(frozen=True)
class BalancedChoice:
    """The balanced search's result."""

    runs: RunSpec  # (rank, start, length) of the ranges each rank owns
    label: str  # the chosen candidate, e.g. "zigzag@0.5/strict" or "zigzag@1.0 > pack x2 + swaps"
    # None where the search chose without the exact pricing (one level, one row, no per-message
    # latency) or priced a mix with sliding windows: the plan counts its own tables then.
    tables: Optional[ChosenTables] = None


def balanced_runs(ids: torch.Tensor, cp: int, cost_model: CostModel, windows: Optional[WindowMix] = None,
                  doc_runs: Optional[Sequence[DocRuns]] = None, tuning: BalancedTuning = DEFAULT_TUNING) -> RunSpec:
    """ids: [R, P] padded doc ids. The chosen layout's runs (``balanced_search``)."""
    return balanced_search(ids, cp, cost_model, windows, doc_runs, tuning).runs


def balanced_search(ids: torch.Tensor, cp: int, cost_model: CostModel, windows: Optional[WindowMix] = None,
                    doc_runs: Optional[Sequence[DocRuns]] = None,
                    tuning: BalancedTuning = DEFAULT_TUNING) -> BalancedChoice:
    """ids: [R, P] padded doc ids. The best candidate (see the module docstring).

    ``windows``: the model's sliding windows (``cost.WindowMix``; None: full attention): every
    candidate is priced as the layers' mix of windowed work and windowed needed keys.
    ``doc_runs``: ``intervals.document_runs`` of every row, when the caller has them.
    ``tuning``: the constants that steer the search (``tuning.DEFAULT_TUNING``).
    """
    cost_model.check_group(cp)
    R, P = ids.shape
    table = UnitTable([document_runs(row) for row in ids] if doc_runs is None else list(doc_runs), P, windows)
    whole: Spans = [(0, P)]
    exact_needed = R > 1 or cost_model.seconds_per_message > 0
    if not cost_model.spans_nodes(cp) or R > 1:
        # One level (or several rows of ids: one search, priced exactly at the end).
        found = find_candidates(table, whole, cp, cost_model.positions_per_pair, tuning)
        if not exact_needed and not cost_model.spans_nodes(cp):
            best = found.choose()
            return BalancedChoice(found.runs(best), found.labels[best])
        finalists = [(found.labels[c], found.owned(c)) for c in found.order()[:tuning.node_finalists + 2]]
    else:
        finalists = node_finalists(table, cp, cost_model, tuning)
    L = P // cp
    peers: List[Tuple[str, Owned]] = [("contiguous", [[(r * L, (r + 1) * L)] for r in range(cp)])]
    if P % (2 * cp) == 0:
        half = L // 2
        peers.append(("zigzag", [[(r * half, (r + 1) * half), ((2 * cp - 1 - r) * half, (2 * cp - r) * half)]
                                 for r in range(cp)]))
    return _choose_exact(table, cp, cost_model, peers + finalists, tuning, n_peers=len(peers),
                         prefer_balance=not cost_model.spans_nodes(cp))


def _choose_exact(table: UnitTable, cp: int, cost_model: CostModel, candidates: Sequence[Tuple[str, Owned]],
                  tuning: BalancedTuning, n_peers: int, prefer_balance: bool = True) -> BalancedChoice:
    """Price every candidate with the full model (``hierarchy.needed_traffic``) and pick by ``choose``
    (``prefer_balance``) or the least modeled time (near-ties: the best balance)."""
    from ...hierarchy import needed_traffic

    P = table.P
    n_cand, group, a, b = flatten([owned for _, owned in candidates], cp)
    modeled, imbalance = [math.inf] * n_cand, [math.inf] * n_cand
    tables = {}  # candidate -> its ChosenTables (full attention only)

    def price(c: int) -> None:
        runs = RankRuns.build(cp, P, *runs_of(c, cp, group, a, b))
        total, mixed = 0.0, torch.zeros(cp, dtype=torch.float64)
        for window, share in table.windows.shares:  # each share of layers with its own needed keys
            work, dst, ia, ib = work_and_intervals(runs, table.rows, window)
            counts = overlap_counts(runs, dst, ia, ib)
            traffic, routes = needed_traffic(runs, (dst, ia, ib), counts, cost_model)  # routes: for the plan
            total += share * cost_model.modeled_seconds(work, traffic)
            mixed += share * work.double()
            if window is None and share == 1.0:
                tables[c] = ChosenTables(runs, work, (dst, ia, ib), counts, routes, cost_model.ranks_per_node)
        modeled[c] = total
        imbalance[c] = float(mixed.max()) / max(float(mixed.mean()), 1e-9)

    if prefer_balance or len(table.rows) > 1:
        for c in range(n_cand):
            price(c)
    else:
        # The finalists first; a peer is priced only if a lower bound of its time (its work plus every
        # key it needs at the intra-node price: each arrives over NVLink or the dearer IB) comes near.
        for c in range(n_peers, n_cand):
            price(c)
        best = min(modeled[n_peers:])
        k = int(torch.searchsorted(group, torch.tensor(n_peers * cp)))  # the peers lead the flat ranges
        peer_flat = (n_peers, group[:k], a[:k], b[:k])
        bound = torch.zeros(n_peers, dtype=torch.float64)
        for window, share in table.windows.shares:
            work, need, _ = candidate_traffic(table, cp, *peer_flat, window=window)
            bound += share * (work.double() * cost_model.seconds_per_pair
                              + need.double() * cost_model.seconds_per_position).max(1).values
        for c in range(n_peers):
            if float(bound[c]) <= best * (1 + tuning.tie):
                price(c)
    modeled_t, imbalance_t = np.array(modeled, dtype=np.float64), np.array(imbalance, dtype=np.float64)
    if prefer_balance:
        best = choose(modeled_t, imbalance_t, n_peers, tuning)
    else:  # near-ties broken by balance, never worse than a peer
        near = (modeled_t <= modeled_t.min() * (1 + tuning.tie)) & (modeled_t <= modeled_t[:n_peers].min())
        best = int(np.argmin(np.where(near, imbalance_t, math.inf)))
    return BalancedChoice(runs_of(best, cp, group, a, b), candidates[best][0], tables.get(best))
