"""The constants that steer the balanced search, in one frozen dataclass.

``DEFAULT_TUNING`` holds the values the search runs with; ``balanced_runs(..., tuning=)`` takes
another (``dataclasses.replace(DEFAULT_TUNING, ...)``) for experiments and tests. Each value is
chosen on the bench's scale and worst-case mixes (bench/SUMMARY.md) and on the tiny inputs the
tests compare with an exhaustive optimum.
"""

import math
from dataclasses import dataclass
from typing import Tuple

_SPLIT_THRESHOLDS = (math.inf, 1.0, 0.75, 0.5, 0.35, 0.25)


@dataclass(frozen=True)
class BalancedTuning:
    # The one-level choice: a candidate within ``balance_goal`` (work max/mean) wins if its modeled
    # time is at most ``balance_price`` above the best and no worse than contiguous or zigzag: an
    # unbalanced attention also idles the token-balanced rest of the layer, which the attention-only
    # model does not see.
    balance_goal: float = 1.05
    balance_price: float = 0.2
    # Candidates whose modeled time is within this fraction of the best count as ties, broken by work
    # balance (imbalance is a preference, not a cost here).
    tie: float = 0.005
    # Split thresholds: the fraction of a rank's work share a document may carry whole ("zigzag"
    # splits at each; "need" splits at ``need_thresholds`` only).
    split_thresholds: Tuple[float, ...] = _SPLIT_THRESHOLDS
    need_thresholds: Tuple[float, ...] = (0.5,)
    # Two levels: the split thresholds of the node-level search and of the per-node searches. The low
    # ones spread a node's share of a long document (its head: little work, many keys to send) over
    # more of the node's ranks than two.
    node_level_thresholds: Tuple[float, ...] = _SPLIT_THRESHOLDS + (0.1, 0.04)
    node_thresholds: Tuple[float, ...] = _SPLIT_THRESHOLDS + (0.1, 0.04)
    # Two levels: the node layouts (best first) that get the per-node searches and a full pricing.
    node_finalists: int = 1
    # Two levels: rounds of equal-length range swaps inside the nodes of the best node layout, at most
    # ``node_swap_rounds`` and at most ``swap_round_positions`` / P (a round's cost grows with the
    # sequence, so the pass costs about the same CPU at any length), none past ``swap_max_positions``
    # (where the pass would cost a large share of the planning budget for little).
    node_swap_rounds: int = 32
    swap_round_positions: int = 32 * 131072
    swap_max_positions: int = 1 << 19
    # Two levels: range swaps between nodes (as many rounds as inside nodes, none past
    # ``node_swap_max_positions``) start from the ``node_swap_starts`` best node layouts and
    # node-level contiguous; a round scores every swap off the busiest node when there are at most
    # ``node_swap_score_all`` (else the work estimate shortlists) and gives up on two nodes holding
    # more than ``node_swap_pairs`` pairs of ranges (the scoring would cost more than the whole
    # search). The ``node_swap_keep`` best node layouts reached get the per-node searches and a swap
    # pass inside nodes of at most ``node_swap_round_positions`` / P rounds.
    node_swap_starts: int = 5
    node_swap_score_all: int = 64
    node_swap_keep: int = 2
    node_swap_pairs: int = 16
    node_swap_round_positions: int = 2 * 131072
    node_swap_max_positions: int = 1 << 18
    # A swap round scores at most this many peers of the busiest rank (the best swap with each), best
    # estimates first (``swaps.RangeSwaps``).
    swap_peers: int = 16
    # Steps 2-3 of split-and-pack run in lockstep (``packing.pack_lockstep``) when the packings' whole
    # units are at least this many times the longest packing's: one numpy step costs about what a few
    # dozen packings' Python steps do.
    lockstep_width: int = 32
    # Runs of consecutive tiny documents are bundled into units of at most this fraction of a rank's
    # share (never split, so the search loops over fewer units).
    bundle_fraction: float = 1 / 16


DEFAULT_TUNING = BalancedTuning()
