"""The balanced search's tuning constants."""

import math

BALANCE_GOAL = 1.05
# Split thresholds (fraction of a rank's work share a document may carry whole).
SPLIT_THRESHOLDS = (math.inf, 1.0, 0.75, 0.5, 0.35, 0.25)
# Candidates whose modeled time is within this fraction of the best count as ties, broken by work
# balance (the rest of the layer is token-balanced; imbalance is a preference, not a cost here).
TIE = 0.005
# Work balance within BALANCE_GOAL is worth this much modeled time: attention imbalance also idles the
# token-balanced rest of the layer on the other ranks, which the attention-only model does not see.
BALANCE_PRICE = 0.2
# "need" splits at these thresholds only (the others never won on the scale and worst-case mixes).
NEED_THRESHOLDS = (0.5,)
# Two levels: the split thresholds of the node-level search (over every unit of the sequence) and of
# the per-node searches. The low ones spread a node's share of a long document (its head: little
# work, many keys to send) over more of the node's ranks than two, which sent its whole prefix.
NODE_LEVEL_THRESHOLDS = SPLIT_THRESHOLDS + (0.1, 0.04)
NODE_THRESHOLDS = SPLIT_THRESHOLDS + (0.1, 0.04)
# Two levels: the node layouts (best first) that get an intra-node search and a full pricing.
NODE_FINALISTS = 1
# Two levels: rounds of equal-length range swaps (``swaps``) over the nodes of the best node layout,
# at most NODE_SWAP_ROUNDS and at most SWAP_ROUND_POSITIONS / P (a round's cost grows with the
# sequence: the pass costs about the same CPU at any length; 32 rounds at 128k, 4 at 1M).
NODE_SWAP_ROUNDS = 32
SWAP_ROUND_POSITIONS = 32 * 131072
# ... and not past SWAP_MAX_POSITIONS: at 1M positions 4 rounds and the exact pricing of one more
# finalist cost ~25 ms of a 100 ms planning budget and gained <= 0.004x ideal (bench/SUMMARY.md).
SWAP_MAX_POSITIONS = 1 << 19
# Two levels: range swaps between nodes (``_swapped_node_layouts``; as many rounds as inside nodes,
# off past NODE_SWAP_MAX_POSITIONS: at 512k / cp 32 they changed none of the 27 mixes' layouts and
# cost ~28 ms a plan) start from the NODE_SWAP_STARTS best node layouts and node-level
# contiguous; a round scores every swap off the busiest node when there are at most
# NODE_SWAP_SCORE_ALL (else the work estimate shortlists) and gives up on two nodes holding more than
# NODE_SWAP_PAIRS pairs of ranges (a many-range node layout: the swaps' scoring would cost more than
# the whole search). The NODE_SWAP_KEEP best node layouts reached get the per-node searches and a
# swap pass inside nodes of at most NODE_SWAP_ROUND_POSITIONS / P rounds (2 at 128k).
# Chosen on the 27 scale and worst-case mixes at 128k / cp 16 (mean modeled / ideal 1.143 -> 1.136,
# layout time ~1.8x) and on tiny inputs (none above the exhaustive optimum, tests/test_topology.py).
NODE_SWAP_STARTS = 5
NODE_SWAP_SCORE_ALL = 64
NODE_SWAP_KEEP = 2
NODE_SWAP_PAIRS = 16
NODE_SWAP_ROUND_POSITIONS = 2 * 131072
NODE_SWAP_MAX_POSITIONS = 1 << 18
# Steps 2-3 run in lockstep (``pack_lockstep``) when the packings' whole units are at least this many
# times the longest packing's (its steps): one numpy step costs about what ~30 packings' Python steps
# do (measured at 1M / cp 64: a group's 8 nodes at every threshold, 40-70 packings of ~100 units).
LOCKSTEP_WIDTH = 32
# Runs of consecutive tiny documents are bundled into units of at most this fraction of a rank's share.
BUNDLE_FRACTION = 1 / 16
