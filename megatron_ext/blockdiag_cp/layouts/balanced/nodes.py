"""Two levels: the node-level search, the per-node searches, and range swaps inside and between nodes."""

from typing import List, Optional, Sequence, Tuple

import numpy as np

from ...cost import CostModel
from .candidates import Candidates, find_candidates, find_candidates_many
from .swaps import RangeSwaps, RangeWork, merged_spans
from .traffic import NodeExchange, flatten_np, rank_counts
from .tuning import BalancedTuning
from .units import Owned, Spans, UnitTable


def node_finalists(table: UnitTable, cp: int, cost_model: CostModel, tuning: BalancedTuning
                   ) -> List[Tuple[str, Owned]]:
    """Two levels (a ``cost_model`` whose group of ``cp`` ranks spans nodes): the node-level search,
    then for its best node layouts (and those the swaps between nodes reach) the per-node searches
    and the swaps inside nodes: the labelled layouts the exact pricing picks among."""
    P = table.P
    whole: Spans = [(0, P)]
    g = cost_model.ranks_per_node
    # Bundles no coarser than the ranks' (a node-level bundle lands whole in one node's sub-search).
    nodes = find_candidates(table, whole, cp // g, cost_model.positions_per_pair_inter, tuning,
                            bundle=max(1, int(P // cp * tuning.bundle_fraction)),
                            thresholds=tuning.node_level_thresholds)
    finalists = []
    q = cost_model.positions_per_pair
    node_layouts = [(nodes.labels[c], nodes.owned(c)) for c in nodes.order()[:tuning.node_finalists]]
    searched = len(node_layouts)  # the node search's own; after them, those the node swaps reached
    if table.windows.full_only:
        node_layouts += _swapped_node_layouts(table, nodes, cost_model.positions_per_pair_inter, tuning)
    for k, (node_label, node_owned) in enumerate(node_layouts):
        per_node, labels = [], []
        # Which rank of a node sends the rows other nodes read is the node's own choice: priced in
        # its search (the hierarchical exchange, full attention; the exact pricing judges the rest).
        exchange = NodeExchange(table, node_owned, g, cost_model.positions_per_pair_inter) \
            if cost_model.hierarchical and table.windows.full_only else None
        for inner in find_candidates_many(table, [merged_spans(spans) for spans in node_owned], g, q, tuning,
                                          thresholds=tuning.node_thresholds, exchange=exchange):
            best = inner.cheapest()
            per_node.append(inner.owned(best))
            labels.append(inner.labels[best])
        label = f"{node_label} > {_summarize(labels)}"
        finalists.append((label, [spans for owned in per_node for spans in owned]))
        if table.windows.full_only:
            # The node search's own layouts get the full pass; the swapped ones a shorter one.
            positions = tuning.swap_round_positions if k < searched else tuning.node_swap_round_positions
            swapped = _swapped_nodes(table, per_node, g, q, tuning, positions, exchange)
            if swapped is not None:
                finalists.append((f"{label} + swaps", swapped))
    return finalists


def _swapped_nodes(table: UnitTable, per_node: Sequence[Owned], g: int, q: float, tuning: BalancedTuning,
                   positions: int, exchange: Optional[NodeExchange] = None) -> Optional[Owned]:
    """The group's layout after range swaps (``swaps``) inside its nodes, each node scored like its
    search (work + q * max(in, out) over its g ranks, keys from other nodes received like the rest,
    plus ``exchange``'s IB time); None if no swap helped (or the sequence is too long for the pass:
    ``tuning.swap_max_positions``); at most ``positions`` / P rounds."""
    rounds = _swap_rounds(table.P, positions, tuning.swap_max_positions, tuning)
    if rounds == 0:
        return None

    def score(cands: Sequence[Owned], pairs, base) -> np.ndarray:
        # A swap inside node n changes only node n's scores.
        jobs = [(0, n) for n in range(len(cands[0]) // g)] if pairs is None else \
            [(k, A // g) for k, (A, _) in enumerate(pairs)]
        flat = flatten_np([cands[k][n * g:(n + 1) * g] for k, n in jobs], g)
        node_scores = rank_counts(table, g, flat, q)  # [jobs, g]
        if exchange is not None:
            node_scores += exchange.pairs(np.array([n for _, n in jobs]), *flat)
        scores = np.zeros((len(cands), len(cands[0]))) if base is None else np.tile(base, (len(cands), 1))
        for (k, n), row in zip(jobs, node_scores):
            scores[k, n * g:(n + 1) * g] = row
        return scores

    search = RangeSwaps([spans for node in per_node for spans in node], score, _range_work(table), group=g,
                        peers=tuning.swap_peers)
    for _ in range(rounds):
        if not search.step():
            break
    return search.owned if search.swaps else None


def _swapped_node_layouts(table: UnitTable, nodes: Candidates, q_inter: float, tuning: BalancedTuning
                          ) -> List[Tuple[str, Owned]]:
    """Node layouts after range swaps between nodes (``swaps``, any length halving the shorter range),
    each node one rank of the node-level search's count (work + q_inter * max(in, out)), from the
    ``tuning.node_swap_starts`` best node layouts and node-level contiguous: the
    ``tuning.node_swap_keep`` best by that count (its busiest node) of those that no start already is.

    The node-level search keeps a document that fits a node whole in one node and splits the rest at
    equal work, so it never cuts a light document where few of its keys would cross: two nodes
    trading a part of their spans each (one document's first token to one node, another's tail to the
    other) can balance their work for a handful of keys over IB."""
    cp = nodes.cp
    rounds = _swap_rounds(table.P, tuning.swap_round_positions, tuning.node_swap_max_positions, tuning)
    if rounds == 0 or cp < 2:
        return []

    def score(cands: Sequence[Owned], pairs, base) -> np.ndarray:
        return rank_counts(table, cp, flatten_np(list(cands), cp), q_inter)

    starts = nodes.order()[:tuning.node_swap_starts]
    starts += [0] if 0 not in starts else []  # 0: node-level contiguous (the search's first candidate)
    seen = [_merged_layout(nodes.owned(c)) for c in starts]
    out: List[Tuple[str, Owned]] = []
    for c in starts:
        search = RangeSwaps(nodes.owned(c), score, _range_work(table), halvings=True,
                            score_all=tuning.node_swap_score_all, max_pairs=tuning.node_swap_pairs,
                            peers=tuning.swap_peers)
        for _ in range(rounds):
            if not search.step():
                break
        if search.swaps and search.owned not in seen:
            seen.append(search.owned)
            out.append((float(search.total.max()), len(out), f"{nodes.labels[c]} + node swaps", search.owned))
    return [(label, owned) for _, _, label, owned in sorted(out)[:tuning.node_swap_keep]]


def _swap_rounds(P: int, positions: int, max_positions: int, tuning: BalancedTuning) -> int:
    """Rounds of a swap pass over P positions: ``tuning.node_swap_rounds``, fewer past ``positions`` / P,
    none past ``max_positions``."""
    return min(tuning.node_swap_rounds, positions // P) if P <= max_positions else 0


def _merged_layout(owned: Owned) -> Owned:
    return [merged_spans(spans) for spans in owned]


def _range_work(table: UnitTable) -> RangeWork:
    return RangeWork(table.start, table.alpha, table.beta, table.P)


def _summarize(labels: Sequence[str]) -> str:
    """Per-node choices, counted: 'pack/strict x6, zigzag@0.5 x2'."""
    counts = {}
    for label in labels:
        counts[label] = counts.get(label, 0) + 1
    return ", ".join(f"{k} x{v}" if v > 1 else k for k, v in counts.items())
