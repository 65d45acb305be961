"""The cost-aware balanced layout: equal tokens per rank, the smallest modeled time we can find.

Every candidate is built from document runs alone (no per-position arrays) and
scored on its runs: the busiest rank's causal pairs plus ``q`` times the larger
of the K/V positions it receives and sends (``q``: the cost model's pairs per
position; a rank whose rows many ranks need pays for sending them). Candidates:

- ``contiguous`` and ``zigzag`` themselves, so the result is never worse than either;
- inside a node (two levels): ``striped``, chunks r and g + r of the node's 2g, which
  balances a node whose span starts a document and ends inside the next (a 2-rank
  node: chunks 0, 2 / 1, 3 where zigzag takes 0, 3 / 1, 2);
- split-and-pack: documents heavier than ``theta`` of a rank's work share are
  split over a few ranks (``zigzag`` pairs, which equalise their work, at every
  SPLIT_THRESHOLDS; ``need``, zigzag pairs over the least loaded ranks, at
  NEED_THRESHOLDS), the rest packed whole by
  work and tokens, the ranks' documents laid end to end and cut at multiples of
  the local length; a piece of a document that later pieces on other ranks read
  (a node's head of a document split across nodes) is never kept whole, so no
  single rank sends it to all of them.

Cut from earlier versions once sends were priced (they never beat these on the
scale and worst-case mixes, bench/SUMMARY.md): contiguous chunks of equal cost
and tails carved from a document's end under a budget (both make one rank the
sender of a document's head to every later piece).

Two levels (a ``CostModel`` whose CP group spans nodes): the same search runs
twice. First over nodes, each node a rank of g = ranks_per_node shares, at the
inter-node price: a document light enough for one node stays inside one node,
and only what does not fit a node is split across nodes (its keys cross IB once
per node, ``hierarchy``). Then, for the best node layouts, inside every node over
its g ranks at the intra-node price (what a rank receives includes the remote
keys its node forwards to it), plus each rank's IB time under the hierarchical
exchange (``_NodeExchange``: the window of remote rows it fetches, which the node
layout fixes, or the rows other nodes read that it owns, which the node's search
decides, whichever is larger). That layout is also polished by equal-length range
swaps inside nodes (``swaps``; the busiest rank first, scored like the per-node
searches): the per-node searches split a document over m ranks at equal work
and pack the rest by a greedy key, which leaves a node's ranks 10-20% apart
where a few documents carry most of the work. The node-level peers contiguous
and zigzag nested in themselves are the flat contiguous and zigzag layouts. The
node-level search never cuts a document light enough for one node, even where a
few keys over IB would buy the balance: range swaps between nodes
(``_swapped_node_layouts``, each node one rank of the node-level count) from the
best node layouts add the two best node layouts they reach, each searched and
swapped inside its nodes the same way. The finalists (every node layout's,
swapped and not, and the flat contiguous and zigzag) are priced exactly with
the full model (``hierarchy.layout_traffic``), which picks.

Choice (one level): the least modeled time, except that a candidate within
BALANCE_GOAL (work max/mean) wins if it costs at most BALANCE_PRICE more and is
no worse than contiguous or zigzag: at a few thousand tokens per rank the model
calls balancing dearer than the keys it moves, and an unbalanced attention also
idles the token-balanced rest of the layer, which the model leaves out. Two
levels (node and per-node searches, and the final pick): the least modeled
time, near-ties (TIE) broken by work balance.

Work of a run [x, y) inside a unit (a range on which no row changes document)
is alpha * sum(p) + beta * (y - x) over p in [x, y): alpha real rows, beta the
sum over them of 1 - document start. One row: alpha = 1, beta = 1 - start.
"""

import bisect
import heapq
import math
import threading
from itertools import chain
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from .cost import CostModel, WindowMix
from .intervals import (DocRuns, RankRuns, _expand_np, clip, document_runs, merge_intervals,
                        overlap_counts, overlap_pieces, repeat_arange, window_pairs, work_and_intervals)
from .swaps import RangeSwaps, RangeWork, merged_spans

RunSpec = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (rank, start, length) of owned ranges
Owned = List[List[Tuple[int, int]]]  # per rank, the [a, b) ranges it owns
Span = Tuple[int, int]  # [a, b)
Spans = List[Tuple[int, int]]  # the global ranges a search lays out (all of [0, P), or one node's)
Flat = Tuple[np.ndarray, np.ndarray, np.ndarray]  # (rank, a, b) of a candidate's ranges, by rank

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
# Steps 2-3 run in lockstep (``_pack_lockstep``) when the packings' whole units are at least this many
# times the longest packing's (its steps): one numpy step costs about what ~30 packings' Python steps
# do (measured at 1M / cp 64: a group's 8 nodes at every threshold, 40-70 packings of ~100 units).
LOCKSTEP_WIDTH = 32
# Runs of consecutive tiny documents are bundled into units of at most this fraction of a rank's share.
BUNDLE_FRACTION = 1 / 16
LAST_CHOICE: List[str] = []  # the label of the last candidate chosen (benchmarks and tests read it)
# What the exact pricing computed for the candidate it chose, which the plan of that layout computes
# again (full attention only): (runs, work, (dst, a, b), counts, two-level routes or None, ranks per node).
# ``prepare.prepare_plan`` takes it right after its layout, on the same thread (``take_chosen_tables``):
# per thread, so a plan built ahead on a planning thread and one built in the step never trade tables.
_CHOSEN = threading.local()


def take_chosen_tables() -> Optional[tuple]:
    """What this thread's last exact pricing kept for its choice, once (None if nothing is kept)."""
    chosen = getattr(_CHOSEN, "tables", None)
    _CHOSEN.tables = None
    return chosen


class _UnitTable:
    """The row(s) cut where any row changes document: (start, end, alpha, beta) numpy arrays over
    [0, P) (every reader is numpy).

    ``windows``: the model's sliding windows (``cost.WindowMix``), which every score prices.
    """

    def __init__(self, rows: Sequence[DocRuns], P: int, windows: Optional[WindowMix] = None):
        self.rows, self.P = list(rows), P
        self.windows = WindowMix() if windows is None else windows
        if len(rows) == 1:  # the units are the row's documents
            starts, ends, doc = (x.numpy() for x in rows[0])
            alpha = (doc > 0).astype(np.float64)
            beta = alpha * (1 - starts).astype(np.float64)
            # Where the document of each unit ends: a piece ending before it has later readers.
            self.doc_end = ends
        else:
            starts = torch.unique(torch.cat([r[0] for r in rows]))
            ends = torch.cat([starts[1:], torch.tensor([P])])
            alpha = torch.zeros(starts.numel(), dtype=torch.float64)
            beta = torch.zeros_like(alpha)
            for row_starts, _, row_doc in rows:
                which = torch.searchsorted(row_starts, starts, right=True) - 1
                real = (row_doc[which] > 0).double()
                alpha += real
                beta += real * (1 - row_starts[which]).double()
            starts, ends, alpha, beta = (x.numpy() for x in (starts, ends, alpha, beta))
            self.doc_end = ends
        self.start, self.end, self.alpha, self.beta = starts, ends, alpha, beta


class _Units:
    """What the candidates of one search place: the units of ``spans`` (Python lists, global
    positions) with their work coefficients; runs of consecutive tiny documents are bundled into
    one unit of at most BUNDLE_FRACTION of a rank's share (never split, so the search loops over
    fewer units)."""

    def __init__(self, table: _UnitTable, spans: Spans, cp: int, bundle: int = 0):
        self.rows, self.P, self.spans, self.windows = table.rows, table.P, spans, table.windows
        self.tokens = sum(b - a for a, b in spans)
        # The table's units cut at the spans (``intervals.clip`` of a few spans), in numpy: a handful
        # of small array ops, where torch's dispatch per op cost more than the arithmetic.
        sa = np.array([a for a, _ in spans], dtype=np.int64)
        sb = np.array([b for _, b in spans], dtype=np.int64)
        t_start = table.start
        which, unit = _pieces_np(sa, sb, t_start)
        starts = np.maximum(sa[which], t_start[unit])
        ends = np.minimum(sb[which], table.end[unit])
        alpha, beta = table.alpha[unit], table.beta[unit]
        read_later = ends < table.doc_end[unit]
        n = (ends - starts).astype(np.float64)
        work = alpha * ((starts + ends - 1).astype(np.float64) * n / 2) + beta * n
        # Windows (one row of ids, where a unit is a piece of one document): the layers' mix of windowed
        # work. Several rows: the full-attention coefficients guide the packing; scores stay exact.
        self.mix = None if table.windows.full_only or len(table.rows) > 1 else table.windows.shares
        doc_start = t_start[unit] if len(table.rows) == 1 else starts
        if self.mix is not None:
            s_t, e_t, d_t = (torch.from_numpy(x) for x in (starts, ends, doc_start))
            work = (torch.from_numpy(alpha) * sum(f * window_pairs(s_t, e_t, d_t, w).double()
                                                  for w, f in self.mix)).numpy()
        work = torch.from_numpy(work)  # summed by torch, as the search always has
        self.total = float(work.sum())
        work = work.numpy()
        cap = bundle or max(1, int(self.tokens // cp * BUNDLE_FRACTION))
        # Bundles: a tiny piece joins the bundle before it if it follows a tiny piece that touches it
        # and the bundle stays within cap. Only the cap is sequential: looped over the joinable pieces.
        tiny = (alpha > 0) & (ends - starts <= cap) & ~read_later
        joinable = np.flatnonzero(tiny[1:] & tiny[:-1] & (ends[:-1] == starts[1:])) + 1
        head = np.ones(starts.size, dtype=bool)  # [pieces]: begins a unit
        if joinable.size:
            start_l, end_l = starts.tolist(), ends.tolist()
            bundle_start = 0
            for k in joinable.tolist():
                if head[k - 1]:
                    bundle_start = start_l[k - 1]
                if end_l[k] - bundle_start <= cap:
                    head[k] = False
        first = np.flatnonzero(head)
        last = np.empty_like(first)  # each unit's last piece
        last[:-1] = first[1:] - 1
        last[-1:] = starts.size - 1
        self.doc_start, self.start, self.end = doc_start[first].tolist(), starts[first].tolist(), ends[last].tolist()
        self.alpha, self.beta = alpha[first].tolist(), beta[first].tolist()
        self.bundle, self.shared = tiny[first].tolist(), read_later[first].tolist()
        self.work = work[first].tolist()
        if first.size < starts.size:  # a bundle's work: its pieces' summed in order, as they join
            pieces, first_l, last_l = work.tolist(), first.tolist(), last.tolist()
            for u in np.flatnonzero(last > first).tolist():
                w = pieces[first_l[u]]
                for k in range(first_l[u] + 1, last_l[u] + 1):
                    w += pieces[k]
                self.work[u] = w
        self.by_work = sorted(range(len(self.start)), key=[-w for w in self.work].__getitem__)
        length = ends[last] - starts[first]
        self.neg_len = (-length).tolist()  # minus each unit's tokens: a sort key
        self.length = length.tolist()
        self.range = list(zip(self.start, self.end))  # each unit's (start, end): placed whole as is
        self._splittable = {}  # L -> (units ``light`` can reject, by work; those it rejects at any limit)
        self._halves = {}  # (unit, m) -> ``halves``
        self._arrays = None  # ``arrays``

    def arrays(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(start, length, work) of every unit as numpy arrays (``_pack_lockstep``), made once."""
        if self._arrays is None:
            self._arrays = (np.array(self.start, dtype=np.int64), np.array(self.length, dtype=np.int64),
                            np.array(self.work, dtype=np.float64))
        return self._arrays

    def splittable(self, L: int) -> Tuple[List[int], List[float], List[int]]:
        """(the units ``light`` can reject, by work; minus their work; the positions in that list of
        those it rejects at any limit: longer than L or read later)."""
        if L not in self._splittable:
            order = [i for i in self.by_work if self.alpha[i] != 0 and not self.bundle[i]]
            fixed = [k for k, i in enumerate(order) if self.end[i] - self.start[i] > L or self.shared[i]]
            self._splittable[L] = (order, [-self.work[i] for i in order], fixed)
        return self._splittable[L]

    def heavy(self, limit: float, L: int) -> List[int]:
        """The units ``light(i, limit, L)`` rejects, in ``by_work`` order, without a call per unit: the
        ones over ``limit`` are a prefix of the rest (sorted by work), the others are fixed by L."""
        order, neg_work, fixed = self.splittable(L)
        over = bisect.bisect_left(neg_work, -limit)  # order[:over]: work > limit
        return order[:over] + [order[k] for k in fixed if k >= over]

    def next_heavy(self, k: int, limit: float, L: int) -> Optional[int]:
        """The first position >= k in ``splittable(L)``'s order of a unit ``light(., limit, L)``
        rejects (None: none left): a unit over ``limit`` if k is still inside that prefix, else the
        next one rejected at any limit."""
        order, neg_work, fixed = self.splittable(L)
        if k < bisect.bisect_left(neg_work, -limit):
            return k
        f = bisect.bisect_left(fixed, k)
        return fixed[f] if f < len(fixed) else None

    def halves(self, i: int, m: int) -> List[Tuple[int, Optional[Span], float, Optional[Span], float]]:
        """Unit i cut into 2m equal chunks, rank k of m taking chunks k and 2m-1-k (a ``zigzag`` split):
        per k, (its tokens, head range, its work, tail range, its work), an empty range as None. The
        same (unit, m) recurs across one search's thresholds: kept per unit."""
        key = (i, m)
        if key not in self._halves:
            a, n = self.start[i], self.end[i] - self.start[i]
            bounds = [a + (n * j) // (2 * m) for j in range(2 * m + 1)]
            span = self.span if self.mix is not None else None
            al, be = self.alpha[i], self.beta[i]
            out = []
            for k in range(m):
                ha, hb, ta, tb = bounds[k], bounds[k + 1], bounds[2 * m - 1 - k], bounds[2 * m - k]
                if span is None:  # ``span`` inline: one method call less per chunk
                    head_work = al * (hb * (hb - 1) - ha * (ha - 1)) / 2 + be * (hb - ha)
                    tail_work = al * (tb * (tb - 1) - ta * (ta - 1)) / 2 + be * (tb - ta)
                else:
                    head_work, tail_work = span(i, ha, hb), span(i, ta, tb)
                out.append((hb - ha + tb - ta, (ha, hb) if hb > ha else None, head_work,
                            (ta, tb) if tb > ta else None, tail_work))
            self._halves[key] = out
        return self._halves[key]

    def light(self, i: int, limit: float, L: int) -> bool:
        """Placed whole: padding, a bundle, or at most L tokens and ``limit`` work, and not a head of a
        document whose later pieces (on other ranks) read it: one owner would send it to all of them."""
        return self.alpha[i] == 0 or self.bundle[i] or (
            self.end[i] - self.start[i] <= L and self.work[i] <= limit and not self.shared[i])

    def span(self, i: int, x: int, y: int) -> float:
        """Work of positions [x, y) of unit i (a split unit: never a bundle)."""
        if self.mix is not None:
            return self.alpha[i] * sum(f * _pairs(x, y, self.doc_start[i], w) for w, f in self.mix)
        return self.alpha[i] * (y * (y - 1) - x * (x - 1)) / 2 + self.beta[i] * (y - x)


def _pairs(x: int, y: int, s: int, window: Optional[int]) -> int:
    """``intervals.window_pairs`` of one piece: queries [x, y) of a document starting at s."""
    lo, hi = x - s + 1, y - s
    if window is None:
        return (lo + hi) * (hi - lo + 1) // 2
    w = window + 1
    top = min(hi, w)
    grow = (lo + top) * (top - lo + 1) // 2 if top >= lo else 0
    return grow + max(0, hi - max(lo - 1, w)) * w


class _NodeExchange:
    """Two levels, one node layout: the IB time a node's ranks add to its search's scores, in pairs.

    The hierarchical exchange (``hierarchy``) cuts node N's remote rows R(N) into g
    equal windows and N's j-th rank fetches window j: the node layout alone fixes
    those sizes (``fetch``). A row that m other nodes read is sent over IB m times,
    by whichever rank of its node owns it: that is what a node's search decides. So
    a rank pays q_inter * max(its window, the rows it sends), and the sends below a
    position x, F(x), are piecewise linear; per document, its nodes' reaches (end of
    each node's last piece) sorted r1 <= r2 <= r3:

        [s ........ r1 ........ r2 ........ r3)      one document, held by 3 nodes
         2 other nodes read     1           0        rows sent per position

    A piece [a, b) of a node's rank sends F(b) - F(a) rows.
    """

    def __init__(self, table: _UnitTable, node_owned: Owned, g: int, q_inter: float):
        d_start, d_end, d_id = table.rows[0]
        nodes = len(node_owned)
        _, group, a, b = _flatten_np([node_owned], nodes)
        starts = d_start.numpy()
        which, doc, pa, pb = _real_pieces_np(a, b, starts, d_end.numpy(), d_id.numpy())
        # Holders: (document, node) -> reach and tokens owned; documents in position order.
        _, _, reach, own, h_doc, h_node = _holders(group[which], doc, pa, pb, starts.size, nodes)
        remote = np.bincount(h_node, weights=reach - starts[h_doc] - own, minlength=nodes).astype(np.int64)
        self.fetch = np.diff(remote[:, None] * np.arange(g + 1) // g, axis=1)  # [nodes, g]: |window j of R(N)|
        order = np.lexsort((reach, h_doc))
        d, r = h_doc[order], reach[order]
        first = np.ones(d.size, dtype=bool)
        first[1:] = d[1:] != d[:-1]
        run_start = np.flatnonzero(first)
        holders = np.diff(np.append(run_start, d.size))[np.cumsum(first) - 1]  # per entry: its document's holders
        t = np.arange(d.size) - run_start[np.cumsum(first) - 1]  # 0 .. holders - 1, by reach
        lo = np.where(first, starts[d], np.roll(r, 1))  # from the previous reach (the document start first)
        w = holders - 1 - t
        keep = (w > 0) & (r > lo)
        self.lo, self.hi, self.w = lo[keep], r[keep], w[keep]
        self.below = np.concatenate([[0], np.cumsum(self.w * (self.hi - self.lo))])[:-1]
        self.g, self.q_inter = g, q_inter

    def sent_below(self, x: np.ndarray) -> np.ndarray:
        """F(x): rows sent over IB from positions below x."""
        if self.lo.size == 0:
            return np.zeros(x.shape, dtype=np.int64)
        j = np.searchsorted(self.lo, x, side="right") - 1
        jc = np.maximum(j, 0)
        inside = np.clip(x, self.lo[jc], self.hi[jc]) - self.lo[jc]
        return np.where(j >= 0, self.below[jc] + self.w[jc] * inside, 0)

    def pairs(self, node_of: np.ndarray, n_cand: int, group: np.ndarray, a: np.ndarray, b: np.ndarray
              ) -> np.ndarray:
        """[n_cand, g]: q_inter * max(window fetched, rows sent) of each rank of each candidate
        (``group`` = candidate * g + rank, as ``_flatten_np``; ``node_of``: each candidate's node)."""
        sent = self.sent_below(b) - self.sent_below(a)
        out = np.bincount(group, weights=sent, minlength=n_cand * self.g).reshape(n_cand, self.g)
        return self.q_inter * np.maximum(self.fetch[node_of], out)


def balanced_runs(ids: torch.Tensor, cp: int, cost_model: CostModel, windows: Optional[WindowMix] = None,
                  doc_runs: Optional[Sequence[DocRuns]] = None) -> RunSpec:
    """ids: [R, P] padded doc ids. The best candidate's runs (see the module docstring).

    ``windows``: the model's sliding windows (``cost.WindowMix``; None: full attention): every
    candidate is priced as the layers' mix of windowed work and windowed needed keys.
    ``doc_runs``: ``intervals.document_runs`` of every row, when the caller has them.
    """
    cost_model.check_group(cp)
    R, P = ids.shape
    table = _UnitTable([document_runs(row) for row in ids] if doc_runs is None else list(doc_runs), P, windows)
    whole: Spans = [(0, P)]
    exact_needed = R > 1 or cost_model.seconds_per_message > 0
    if not cost_model.spans_nodes(cp) or R > 1:
        # One level (or several rows of ids: one search, priced exactly at the end).
        found = _search(table, whole, cp, cost_model.positions_per_pair)
        if not exact_needed and not cost_model.spans_nodes(cp):
            best = found.choose()
            LAST_CHOICE[:] = [found.labels[best]]
            return found.runs(best)
        finalists = [(found.labels[c], found.owned(c)) for c in found.order()[:NODE_FINALISTS + 2]]
    else:
        g = cost_model.ranks_per_node
        # Bundles no coarser than the ranks' (a node-level bundle lands whole in one node's sub-search).
        nodes = _search(table, whole, cp // g, cost_model.positions_per_pair_inter,
                        bundle=max(1, int(P // cp * BUNDLE_FRACTION)), thresholds=NODE_LEVEL_THRESHOLDS)
        finalists = []
        q = cost_model.positions_per_pair
        node_layouts = [(nodes.labels[c], nodes.owned(c)) for c in nodes.order()[:NODE_FINALISTS]]
        searched = len(node_layouts)  # the node search's own; after them, those the node swaps reached
        if table.windows.full_only:
            node_layouts += _swapped_node_layouts(table, nodes, cost_model.positions_per_pair_inter)
        for k, (node_label, node_owned) in enumerate(node_layouts):
            per_node, labels = [], []
            # Which rank of a node sends the rows other nodes read is the node's own choice: priced in
            # its search (the hierarchical exchange, full attention; the exact pricing judges the rest).
            exchange = _NodeExchange(table, node_owned, g, cost_model.positions_per_pair_inter) \
                if cost_model.hierarchical and table.windows.full_only else None
            for inner in _search_many(table, [merged_spans(spans) for spans in node_owned], g, q,
                                      thresholds=NODE_THRESHOLDS, exchange=exchange):
                best = inner.cheapest()
                per_node.append(inner.owned(best))
                labels.append(inner.labels[best])
            label = f"{node_label} > {_summarize(labels)}"
            finalists.append((label, [spans for owned in per_node for spans in owned]))
            if table.windows.full_only:
                # The node search's own layouts get the full pass; the swapped ones a shorter one.
                positions = SWAP_ROUND_POSITIONS if k < searched else NODE_SWAP_ROUND_POSITIONS
                swapped = _swapped_nodes(table, per_node, g, q, exchange, positions)
                if swapped is not None:
                    finalists.append((f"{label} + swaps", swapped))
    L = P // cp
    peers: List[Tuple[str, Owned]] = [("contiguous", [[(r * L, (r + 1) * L)] for r in range(cp)])]
    if P % (2 * cp) == 0:
        half = L // 2
        peers.append(("zigzag", [[(r * half, (r + 1) * half), ((2 * cp - 1 - r) * half, (2 * cp - r) * half)]
                                 for r in range(cp)]))
    return _choose_exact(table, cp, cost_model, peers + finalists, n_peers=len(peers),
                         prefer_balance=not cost_model.spans_nodes(cp))


def _swapped_nodes(table: _UnitTable, per_node: Sequence[Owned], g: int, q: float,
                   exchange: Optional[_NodeExchange] = None, positions: int = SWAP_ROUND_POSITIONS
                   ) -> Optional[Owned]:
    """The group's layout after range swaps (``swaps``) inside its nodes, each node scored like its
    search (work + q * max(in, out) over its g ranks, keys from other nodes received like the rest,
    plus ``exchange``'s IB time); None if no swap helped (or the sequence is too long for the pass:
    SWAP_MAX_POSITIONS)."""
    rounds = _swap_rounds(table.P, positions, SWAP_MAX_POSITIONS)
    if rounds == 0:
        return None

    def score(cands: Sequence[Owned], pairs, base) -> np.ndarray:
        # A swap inside node n changes only node n's scores.
        jobs = [(0, n) for n in range(len(cands[0]) // g)] if pairs is None else \
            [(k, A // g) for k, (A, _) in enumerate(pairs)]
        flat = _flatten_np([cands[k][n * g:(n + 1) * g] for k, n in jobs], g)
        node_scores = _rank_counts(table, g, flat, q)  # [jobs, g]
        if exchange is not None:
            node_scores += exchange.pairs(np.array([n for _, n in jobs]), *flat)
        scores = np.zeros((len(cands), len(cands[0]))) if base is None else np.tile(base, (len(cands), 1))
        for (k, n), row in zip(jobs, node_scores):
            scores[k, n * g:(n + 1) * g] = row
        return scores

    search = RangeSwaps([spans for node in per_node for spans in node], score, _range_work(table), group=g)
    for _ in range(rounds):
        if not search.step():
            break
    return search.owned if search.swaps else None


def _swapped_node_layouts(table: _UnitTable, nodes: "_Found", q_inter: float) -> List[Tuple[str, Owned]]:
    """Node layouts after range swaps between nodes (``swaps``, any length halving the shorter range),
    each node one rank of the node-level search's count (work + q_inter * max(in, out)), from the
    NODE_SWAP_STARTS best node layouts and node-level contiguous: the NODE_SWAP_KEEP best by that
    count (its busiest node) of those that no start already is.

    The node-level search keeps a document that fits a node whole in one node and splits the rest at
    equal work, so it never cuts a light document where few of its keys would cross: two nodes
    trading a part of their spans each (one document's first token to one node, another's tail to the
    other) can balance their work for a handful of keys over IB."""
    cp = nodes.cp
    rounds = _swap_rounds(table.P, SWAP_ROUND_POSITIONS, NODE_SWAP_MAX_POSITIONS)
    if rounds == 0 or cp < 2:
        return []

    def score(cands: Sequence[Owned], pairs, base) -> np.ndarray:
        return _rank_counts(table, cp, _flatten_np(list(cands), cp), q_inter)

    starts = nodes.order()[:NODE_SWAP_STARTS]
    starts += [0] if 0 not in starts else []  # 0: node-level contiguous (the search's first candidate)
    seen = [_merged_layout(nodes.owned(c)) for c in starts]
    out: List[Tuple[str, Owned]] = []
    for c in starts:
        search = RangeSwaps(nodes.owned(c), score, _range_work(table), halvings=True,
                            score_all=NODE_SWAP_SCORE_ALL, max_pairs=NODE_SWAP_PAIRS)
        for _ in range(rounds):
            if not search.step():
                break
        if search.swaps and search.owned not in seen:
            seen.append(search.owned)
            out.append((float(search.total.max()), len(out), f"{nodes.labels[c]} + node swaps", search.owned))
    return [(label, owned) for _, _, label, owned in sorted(out)[:NODE_SWAP_KEEP]]


def _swap_rounds(P: int, positions: int, max_positions: int) -> int:
    """Rounds of a swap pass over P positions: NODE_SWAP_ROUNDS, fewer past ``positions`` / P, none
    past ``max_positions``."""
    return min(NODE_SWAP_ROUNDS, positions // P) if P <= max_positions else 0


def _rank_counts(table: _UnitTable, ranks: int, flat, q: float) -> np.ndarray:
    """work + q * max(received, sent) [n_candidates, ranks], full attention, on ``_flatten_np``'s arrays:
    the count the swap passes score (a rank, or a node as one rank)."""
    work, inn, out = _traffic_np(table, ranks, *flat)
    return work.astype(np.float64) + q * np.maximum(inn, out).astype(np.float64)


def _merged_layout(owned: Owned) -> Owned:
    return [merged_spans(spans) for spans in owned]


def _range_work(table: _UnitTable) -> RangeWork:
    return RangeWork(table.start, table.alpha, table.beta, table.P)


def _summarize(labels: Sequence[str]) -> str:
    """Per-node choices, counted: 'pack/strict x6, zigzag@0.5 x2'."""
    counts = {}
    for label in labels:
        counts[label] = counts.get(label, 0) + 1
    return ", ".join(f"{k} x{v}" if v > 1 else k for k, v in counts.items())


class _Found:
    """A search's candidates, flattened (``_flatten_np``), with their modeled cost and work balance
    (numpy: a handful of small reductions, where torch's dispatch per op cost more)."""

    def __init__(self, labels, n_cand, group, a, b, cp, modeled, imbalance, n_peers):
        self.labels, self.n_cand, self.group, self.a, self.b, self.cp = labels, n_cand, group, a, b, cp
        self.modeled, self.imbalance, self.n_peers = modeled, imbalance, n_peers

    def choose(self) -> int:
        return _choice(self.modeled, self.imbalance, self.n_peers)

    def cheapest(self) -> int:
        """The least modeled cost, near-ties (TIE) broken by work balance."""
        near = self.modeled <= self.modeled.min() * (1 + TIE)
        return int(np.argmin(np.where(near, self.imbalance, math.inf)))

    def order(self) -> List[int]:
        """Candidates best first: the cheapest, then by modeled cost."""
        best = self.cheapest()
        rest = [c for c in np.argsort(self.modeled, kind="stable").tolist() if c != best]
        return [best] + rest

    def runs(self, c: int) -> RunSpec:
        return tuple(torch.from_numpy(x) for x in self._runs_np(c))

    def _runs_np(self, c: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        lo, hi = np.searchsorted(self.group, [c * self.cp, (c + 1) * self.cp]).tolist()
        return self.group[lo:hi] - c * self.cp, self.a[lo:hi], self.b[lo:hi] - self.a[lo:hi]

    def owned(self, c: int) -> Owned:
        rank, start, length = self._runs_np(c)
        out: Owned = [[] for _ in range(self.cp)]
        for r, s, n in zip(rank.tolist(), start.tolist(), length.tolist()):
            out[r].append((s, s + n))
        return out


def _choice(modeled: np.ndarray, imbalance: np.ndarray, n_peers: int) -> int:
    """The least modeled time among candidates within BALANCE_GOAL whose modeled time is at most
    BALANCE_PRICE above the best and no worse than the peers (the first ``n_peers``: contiguous and
    zigzag); if none, the least modeled time (near-ties no worse than the peers: the best balance)."""
    peers = float(modeled[:n_peers].min())
    limit = min(float(modeled.min()) * (1 + BALANCE_PRICE), peers)
    goal = (imbalance <= BALANCE_GOAL + 1e-12) & (modeled <= limit)
    if goal.any():
        return int(np.argmin(np.where(goal, modeled, math.inf)))
    # Near-ties, but never worse than a peer: a better balance does not buy modeled time.
    near = (modeled <= modeled.min() * (1 + TIE)) & (modeled <= peers)
    return int(np.argmin(np.where(near, imbalance, math.inf)))


def _search(table: _UnitTable, spans: Spans, cp: int, q: float, bundle: int = 0,
            thresholds: Sequence[float] = SPLIT_THRESHOLDS) -> _Found:
    """Every candidate laying ``spans`` out over ``cp`` ranks, scored by work + q * max(in, out).

    ``bundle``: the most tokens a bundle of tiny documents holds (default: BUNDLE_FRACTION of a rank's share).
    """
    return _search_many(table, [spans], cp, q, bundle, thresholds)[0]


def _search_many(table: _UnitTable, many: Sequence[Spans], cp: int, q: float, bundle: int = 0,
                 thresholds: Sequence[float] = SPLIT_THRESHOLDS,
                 exchange: Optional[_NodeExchange] = None) -> List[_Found]:
    """``_search`` for several independent span sets (a group's nodes), each over its own ``cp`` ranks;
    all candidates are scored together (one batched count instead of one per span set).
    ``exchange``: span set n is node n of that node layout, its ranks' IB time is scored too."""
    units = [_Units(table, spans, cp, bundle) for spans in many]
    cands, n_peers = [], []
    jobs = []  # (search, label, units, ranks after step 1, units left whole) per packing
    for spans, u in zip(many, units):
        L = u.tokens // cp
        c: List[Tuple[str, Owned]] = [("contiguous", _cut(spans, [(r * L, (r + 1) * L) for r in range(cp)]))]
        if L % 2 == 0:
            half = L // 2
            c.append(("zigzag", _cut(spans, [(r * half, (r + 1) * half) for r in range(cp)],
                                     [((2 * cp - 1 - r) * half, (2 * cp - r) * half) for r in range(cp)])))
        n_peers.append(len(c))  # contiguous (and zigzag): the result is never worse than these
        if exchange is not None and L % 2 == 0:
            half = L // 2
            c.append(("striped", _cut(spans, [(r * half, (r + 1) * half) for r in range(cp)],
                                      [((cp + r) * half, (cp + r + 1) * half) for r in range(cp)])))
        target = u.total / cp
        k = len(cands)
        if u.heavy(min(thresholds) * target, L):
            seen = set()  # step-1 splits already packed
            splits = [(f"{style}@{theta}", _split(u, cp, theta, style, seen))
                      for style, ts in (("zigzag", thresholds), ("need", NEED_THRESHOLDS)) for theta in ts]
            jobs += [(k, label, u, *split) for label, split in splits if split is not None]
        else:  # nothing worth splitting: one packing
            jobs.append((k, "pack", u, *_split(u, cp, math.inf, "zigzag")))
        cands.append(c)
    # Steps 2-3 of every packing: in lockstep when there are many (a group's nodes at every threshold).
    if sum(len(whole) for *_, whole in jobs) >= LOCKSTEP_WIDTH * max(len(whole) for *_, whole in jobs):
        packed = _pack_lockstep([(u, ranks, whole) for _, _, u, ranks, whole in jobs], cp)
    else:
        packed = [_pack(u, ranks, whole) for _, _, u, ranks, whole in jobs]
    for (k, label, *_), (stream, strict) in zip(jobs, packed):
        cands[k] += [(label, stream), (f"{label}/strict", strict)]
    costs = _score_many(units[0], cp, q, cands, exchange)
    return [_Found([label for label, _ in c], *cost[2], cp, cost[0], cost[1], n)
            for c, cost, n in zip(cands, costs, n_peers)]


def _score_many(units: "_Units", cp: int, q: float, cands: Sequence[Sequence[Tuple[str, Owned]]],
                exchange: Optional[_NodeExchange] = None):
    """``_score`` of several searches' candidates in one batch; per search (modeled, imbalance, flat).

    A search's imbalance is its work max over its own mean (its spans' share)."""
    sizes = [len(c) for c in cands]
    if sum(sizes) == 0:
        return [None] * len(cands)
    flat = _flatten_np([owned for c in cands for _, owned in c], cp)
    extra = None if exchange is None else exchange.pairs(np.repeat(np.arange(len(cands)), sizes), *flat)
    modeled, work = _mixed_scores(units, cp, flat, q, extra)  # [all candidates], [all candidates, cp]
    # The mean by torch, as the search always has (a mix of windows sums fractions: the order counts).
    imbalance = work.max(1) / np.maximum(torch.from_numpy(work).mean(1).numpy(), 1e-9)
    # Each search's slice of the flat ranges: one binary search for every boundary (groups ascend).
    firsts = [0]
    for n in sizes:
        firsts.append(firsts[-1] + n)
    group = flat[1]
    bounds = np.searchsorted(group, np.array(firsts) * cp).tolist()
    out_list = []
    for k, n in enumerate(sizes):
        first, lo, hi = firsts[k], bounds[k], bounds[k + 1]
        local = (n, group[lo:hi] - first * cp, flat[2][lo:hi], flat[3][lo:hi])
        out_list.append((modeled[first:first + n], imbalance[first:first + n], local))
    return out_list


def _cut(spans: Spans, *parts: Sequence[Tuple[int, int]]) -> Owned:
    """Per rank, the global ranges of offsets [x, y) into the concatenation of ``spans`` (one list of
    offset ranges per argument, rank-indexed)."""
    starts = [0]
    for a, b in spans:
        starts.append(starts[-1] + b - a)
    owned: Owned = [[] for _ in range(len(parts[0]))]
    for per_rank in parts:
        for r, (x, y) in enumerate(per_rank):
            k = max(0, bisect.bisect_right(starts, x) - 1)
            while x < y:
                a, b = spans[k]
                take = min(y, starts[k + 1]) - x
                if take > 0:
                    owned[r].append((a + x - starts[k], a + x - starts[k] + take))
                    x += take
                k += 1
    return owned


def _choose_exact(table: _UnitTable, cp: int, cost_model: CostModel, candidates: Sequence[Tuple[str, Owned]],
                  n_peers: int, prefer_balance: bool = True) -> RunSpec:
    """Price every candidate with the full model (``hierarchy.needed_traffic``) and pick by ``_choice``
    (``prefer_balance``) or the least modeled time (near-ties: the best balance)."""
    from .hierarchy import needed_traffic

    P = table.P
    n_cand, group, a, b = _flatten([owned for _, owned in candidates], cp)
    modeled, imbalance = [math.inf] * n_cand, [math.inf] * n_cand
    tables = {}  # candidate -> what take_chosen_tables hands the plan (full attention only)

    def price(c: int) -> None:
        runs = RankRuns.build(cp, P, *_runs_of(c, cp, group, a, b))
        total, mixed = 0.0, torch.zeros(cp, dtype=torch.float64)
        for window, share in table.windows.shares:  # each share of layers with its own needed keys
            work, dst, ia, ib = work_and_intervals(runs, table.rows, window)
            counts = overlap_counts(runs, dst, ia, ib)
            traffic, routes = needed_traffic(runs, (dst, ia, ib), counts, cost_model)  # routes: for the plan
            total += share * cost_model.modeled_seconds(work, traffic)
            mixed += share * work.double()
            if window is None and share == 1.0:
                tables[c] = (runs, work, (dst, ia, ib), counts, routes, cost_model.ranks_per_node)
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
            work, need, _ = _candidate_traffic(table, cp, *peer_flat, window=window)
            bound += share * (work.double() * cost_model.seconds_per_pair
                              + need.double() * cost_model.seconds_per_position).max(1).values
        for c in range(n_peers):
            if float(bound[c]) <= best * (1 + TIE):
                price(c)
    modeled_t, imbalance_t = np.array(modeled, dtype=np.float64), np.array(imbalance, dtype=np.float64)
    if prefer_balance:
        best = _choice(modeled_t, imbalance_t, n_peers)
    else:  # near-ties broken by balance, never worse than a peer
        near = (modeled_t <= modeled_t.min() * (1 + TIE)) & (modeled_t <= modeled_t[:n_peers].min())
        best = int(np.argmin(np.where(near, imbalance_t, math.inf)))
    LAST_CHOICE[:] = [candidates[best][0]]
    _CHOSEN.tables = tables.get(best)
    return _runs_of(best, cp, group, a, b)


def _flatten(owned_lists: Sequence, cp: int) -> Tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_flatten_np`` as tensors."""
    n, group, a, b = _flatten_np(owned_lists, cp)
    return n, torch.from_numpy(group), torch.from_numpy(a), torch.from_numpy(b)


def _flatten_np(owned_lists: Sequence, cp: int) -> Tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """Every candidate's ranges as flat int64 arrays, candidate-major: (count, candidate * cp + rank, a, b).
    A candidate: an ``Owned`` or ``_pack_lockstep``'s (rank, a, b) arrays."""
    lists = [k for k, owned in enumerate(owned_lists) if isinstance(owned, list)]
    per_rank = [spans for k in lists for spans in owned_lists[k]]
    count = np.fromiter(map(len, per_rank), dtype=np.int64, count=len(per_rank))
    # numpy reads the flat ints several times faster than torch.tensor does.
    ab = np.fromiter(chain.from_iterable(chain.from_iterable(per_rank)), dtype=np.int64).reshape(-1, 2)
    if len(lists) == len(owned_lists):
        group, a, b = repeat_arange(count), ab[:, 0].copy(), ab[:, 1].copy()
    else:  # each list's ranges in its candidate's place
        ends = np.cumsum(count.reshape(-1, cp).sum(1))[:-1]
        rows, ranks = np.split(np.arange(ab.shape[0]), ends), np.split(repeat_arange(count) % cp, ends)
        flat = dict(zip(lists, ((r, ab[i, 0], ab[i, 1]) for r, i in zip(ranks, rows))))
        parts = [flat.get(k, owned) for k, owned in enumerate(owned_lists)]
        group = np.concatenate([r + k * cp for k, (r, _, _) in enumerate(parts)])
        a, b = (np.concatenate([p[x] for p in parts]) for x in (1, 2))
    return len(owned_lists), group, a, b


def _runs_of(c: int, cp: int, group: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> RunSpec:
    lo, hi = torch.searchsorted(group, torch.tensor([c * cp, (c + 1) * cp])).tolist()
    return group[lo:hi] - c * cp, a[lo:hi], b[lo:hi] - a[lo:hi]


def _mixed_scores(units, cp: int, flat, q: float, extra: Optional[np.ndarray] = None
                  ) -> Tuple[np.ndarray, np.ndarray]:
    """(modeled [n_candidates], work [n_candidates, cp]) under the table's window mix: per share of
    layers, the busiest rank's work + q * max(received, sent) (+ ``extra`` [n_candidates, cp], full
    attention only), weighed by the shares; work likewise. ``flat``: ``_flatten_np``'s."""
    # In numpy (elementwise ops and a max, as torch's, without its dispatch per op on small arrays).
    modeled = np.zeros(flat[0])
    mixed = np.zeros((flat[0], cp))
    for window, share in units.windows.shares:
        if window is None and len(units.rows) == 1:
            work, inn, out = _traffic_np(units, cp, *flat)  # [all candidates, cp]
        else:
            n, group, a, b = flat
            traffic = _candidate_traffic(units, cp, n, *(torch.from_numpy(x) for x in (group, a, b)), window=window)
            work, inn, out = (x.numpy() for x in traffic)
        rank = work.astype(np.float64) + q * np.maximum(inn, out).astype(np.float64)
        if extra is not None:
            rank = rank + extra
        modeled += share * rank.max(1)
        mixed += share * work.astype(np.float64)
    return modeled, mixed


def _candidate_traffic(units, cp: int, n_cand: int, group: torch.Tensor, a: torch.Tensor,
                       b: torch.Tensor, window: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(work, received, sent) [n_candidates, cp] of every candidate at once (``units``: a ``_Units``
    or the ``_UnitTable``: only its rows of document runs and P are read); ``window``: of a layer
    with that sliding window (``_windowed_traffic``).

    ``group`` = candidate * cp + rank of every range [a, b). A rank's pieces of one
    document need [document start, end of its last piece) minus what it owns
    (the plan's count), wherever those keys are: positions outside the search's
    spans (another node's) count as received too. A piece [pa, pb) of s sends
    min(pb, reach_h) - pa (if positive) to every other rank h of the candidate
    holding the document up to reach_h. Several rows of ids: the plan's own
    counting per candidate (whole layouts only).
    """
    if len(units.rows) > 1:
        out = []
        for c in range(n_cand):
            runs = RankRuns.build(cp, units.P, *_runs_of(c, cp, group, a, b))
            work, dst, ia, ib = work_and_intervals(runs, units.rows, window)
            counts = overlap_counts(runs, dst, ia, ib)
            out.append((work, counts.sum(0), counts.sum(1)))
        return tuple(torch.stack(x) for x in zip(*out))
    if window is not None:
        return _windowed_traffic(units.rows[0], units.P, cp, n_cand, group, a, b, window)
    return tuple(torch.from_numpy(x) for x in _traffic_np(units, cp, n_cand, group.numpy(), a.numpy(), b.numpy()))


def _traffic_np(units, cp: int, n_cand: int, group: np.ndarray, a: np.ndarray, b: np.ndarray
                ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``_candidate_traffic`` of one row of ids, full attention, on ``_flatten_np``'s arrays."""
    d_start, d_end, d_id = (x.numpy() for x in units.rows[0])
    n_docs = d_start.size
    # In numpy (a few dozen small array ops, each cheaper than torch's dispatch); sums by bincount's
    # float64 weights, exact: every partial sum is an integer far below 2**53.
    which, doc, pa, pb = _real_pieces_np(a, b, d_start, d_end, d_id)
    starts = d_start
    g, s = group[which], starts[doc]
    size = n_cand * cp

    def total(index, values, n):
        return np.bincount(index, weights=values, minlength=n).astype(np.int64)

    work = total(g, (pa + pb - 2 * s + 1) * (pb - pa) // 2, size)
    key, inverse, reach, own, h_doc, h_group = _holders(g, doc, pa, pb, n_docs, cp)
    inn = total(h_group, reach - starts[h_doc] - own, size)
    # Sends: every piece against the other holders of its (candidate, document).
    # A piece's (candidate, document) is its holder's (key[inverse]): its holders are the run of
    # equal holder_cd (sorted) around inverse, bounded by where holder_cd changes (no binary searches).
    holder_cd = key // cp
    change = np.ones(key.size + 1, dtype=bool)
    change[1:-1] = holder_cd[1:] != holder_cd[:-1]
    bound = np.flatnonzero(change)  # [distinct (candidate, document) + 1] each run's first holder, then the end
    run = (np.cumsum(change[:-1]) - 1)[inverse]  # each piece's run
    lo, hi = bound[run], bound[run + 1]
    pieces = np.flatnonzero(hi - lo > 1)
    out = np.zeros(size, dtype=np.int64)
    if pieces.size:
        p, h = _expand_np(lo[pieces], (hi - lo)[pieces])
        p = pieces[p]
        sent = np.maximum(np.minimum(pb[p], reach[h]) - pa[p], 0)
        # Against every holder, its own among them (reach >= pb: pb - pa), taken off after the sums
        # (exact: integers) instead of a rank test per (piece, holder).
        out = total(g[p], sent, size) - total(g[pieces], (pb - pa)[pieces], size)
    return tuple(x.reshape(n_cand, cp) for x in (work, inn, out))


def _real_pieces_np(a: np.ndarray, b: np.ndarray, d_start: np.ndarray, d_end: np.ndarray, d_id: np.ndarray
                    ) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``intervals._real_pieces`` of ``clip(a, b, d_start, d_end)`` in numpy only (range index, document,
    pa, pb; in range order): the search's ranges are a few thousand, where converting to and from
    torch cost as much as the two binary searches."""
    which, doc = _pieces_np(a, b, d_start)
    real = d_id[doc] > 0
    if not real.all():
        which, doc = which[real], doc[real]
    return which, doc, np.maximum(a[which], d_start[doc]), np.minimum(b[which], d_end[doc])


def _pieces_np(a: np.ndarray, b: np.ndarray, starts: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Nonempty ranges [a, b) against a partition of [0, P) (its parts' starts, ascending): (range, part)
    of every piece, in range order (``intervals.clip``'s two binary searches, in numpy)."""
    first = np.searchsorted(starts, a, side="right") - 1
    count = np.searchsorted(starts, b - 1, side="right") - first
    which = repeat_arange(count)
    # Piece t of range i is part first[i] + t - (i's first piece): one gather and an add, where
    # ``_expand_np``'s general ranges cost a few more passes (these counts are never zero).
    end = np.cumsum(count)
    return which, np.arange(end[-1] if end.size else 0) + (first + count - end)[which]


def _holders(g: np.ndarray, doc: np.ndarray, pa: np.ndarray, pb: np.ndarray, n_docs: int, cp: int):
    """The holders of real pieces [pa, pb) of documents ``doc`` on ranks g = candidate * cp + rank:
    (key, inverse, reach, own, doc, group) per (candidate, document, rank), sorted by key
    ((candidate * n_docs + document) * cp + rank), each piece's holder, the end of its last piece,
    the tokens it owns, its document and its g."""
    cand, rank = np.divmod(g, cp)
    full = (cand * n_docs + doc) * cp + rank
    # ``np.unique(full, return_inverse=True)`` by a stable sort: the pieces come candidate-major and
    # by rank, so ``full`` is a few ascending runs per candidate, which the merge sort takes whole
    # (np.unique's quicksort does not; any order of equal keys gives the same holders).
    perm = np.argsort(full, kind="stable")
    ordered = full[perm]
    first = np.empty(ordered.size, dtype=bool)
    first[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    key = ordered[first]
    inverse = np.empty(ordered.size, dtype=np.int64)
    inverse[perm] = np.cumsum(first) - 1
    reach = np.zeros(key.size, dtype=np.int64)
    np.maximum.at(reach, inverse, pb)
    own = np.bincount(inverse, weights=pb - pa, minlength=key.size).astype(np.int64)
    return key, inverse, reach, own, (key // cp) % n_docs, (key // cp // n_docs) * cp + key % cp


def _windowed_traffic(row: DocRuns, P: int, cp: int, n_cand: int, group: torch.Tensor, a: torch.Tensor,
                      b: torch.Tensor, window: Optional[int]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_candidate_traffic`` of one row of ids by the plan's own rule, for any window (None: full).

    A piece [pa, pb) of a document starting at s needs [max(s, pa - window), pb)
    (``intervals.work_and_intervals``); a rank's needs, merged, minus what it owns are
    what it receives; what an owner sends is its positions inside the other ranks'
    needs of its candidate. Every candidate at once: rank g = candidate * cp + rank keys
    its intervals and runs by g * (P + 1) + position, a candidate's runs by
    candidate * (P + 1) + position. Positions no rank of a search owns (another node's)
    are received, and sent by no one here.
    """
    d_start, d_end, d_id = row
    size = n_cand * cp
    stride = P + 1
    which, doc, pa, pb = clip(a, b, d_start, d_end)
    real = d_id[doc] > 0
    which, doc, pa, pb = which[real], doc[real], pa[real], pb[real]
    g, s = group[which], d_start[doc]
    work = torch.zeros(size, dtype=torch.long).index_add_(0, g, window_pairs(pa, pb, s, window))
    if g.numel() == 0:
        zero = torch.zeros(n_cand, cp, dtype=torch.long)
        return work.view(n_cand, cp), zero, zero.clone()
    lo = s if window is None else torch.maximum(s, pa - window)
    ng, na, nb = merge_intervals(g, lo, pb, P)  # every rank's needs, disjoint, by (g, position)
    order = torch.argsort(group * stride + a)  # runs by (g, position); also by (candidate, position)
    og, oa, ob = group[order], a[order], b[order]
    # What a rank owns of its own needs.
    q, t, x, y = overlap_pieces(og * stride + oa, og * stride + ob, ng * stride + na, ng * stride + nb)
    own = torch.zeros(size, dtype=torch.long).index_add_(0, ng[q], y - x)
    need = torch.zeros(size, dtype=torch.long).index_add_(0, ng, nb - na)
    # Every rank's needs against every run of its candidate: what each owner holds of them.
    by_position = torch.argsort((og // cp) * stride + oa)
    cg, ca, cb = og[by_position], oa[by_position], ob[by_position]
    nc = ng // cp
    q, t, x, y = overlap_pieces((cg // cp) * stride + ca, (cg // cp) * stride + cb, nc * stride + na, nc * stride + nb)
    held = torch.zeros(size, dtype=torch.long).index_add_(0, cg[t], y - x)
    return work.view(n_cand, cp), (need - own).view(n_cand, cp), (held - own).view(n_cand, cp)


class _Ranks:
    """Per-rank owned ranges, free tokens and load (work + q * needed keys) while building."""

    def __init__(self, cp: int, L: int):
        self.owned: Owned = [[] for _ in range(cp)]
        self.room = [L] * cp
        self.load = [0.0] * cp

    def copy(self) -> "_Ranks":
        other = _Ranks(len(self.room), 0)
        other.owned = [list(o) for o in self.owned]
        other.room, other.load = list(self.room), list(self.load)
        return other

    def cut_in(self, spans: Sequence[Tuple[int, int]], order: Optional[Sequence[int]] = None) -> None:
        """Fill the ranks' free tokens (ranks in ``order``) with these ranges, cutting where one is full."""
        order = range(len(self.room)) if order is None else order
        room, owned = self.room, self.owned
        k = 0
        r = order[0] if order else 0
        for span in spans:
            a, b = span
            if a >= b:
                continue
            while room[r] == 0:
                k += 1
                r = order[k]
            if room[r] >= b - a:  # the usual case: it fits the current rank whole
                owned[r].append(span)
                room[r] -= b - a
                continue
            while a < b:
                while room[r] == 0:
                    k += 1
                    r = order[k]
                take = room[r] if room[r] < b - a else b - a
                owned[r].append((a, a + take))
                room[r] -= take
                a += take
        assert not any(room), room  # every rank full (room is never negative)


def _split_and_pack(units: _Units, cp: int, theta: float, style: str,
                    seen: Optional[set] = None) -> Optional[Tuple[Owned, Owned]]:
    """Split heavy documents by ``style``, pack the rest whole, cut at multiples of L.

    1. A unit whose tokens exceed a rank's share, or whose work exceeds ``theta``
       of a rank's work share, is split over m ranks (``zigzag``: 2m chunks,
       rank i of m takes chunks i and 2m-1-i; ``need``: zigzag over the fewest
       least loaded ranks whose missing work covers it).
    2. The other units, largest work first, go whole to the rank that keeps
       max(work / share, tokens / L) smallest.
    3. The ranks' units are laid end to end (largest first within a rank) and
       cut at exact multiples of L.
    Also returned: 2-3 done strictly (each unit whole to the least loaded rank
    it fits in; those that fit nowhere cut into the least loaded free tokens).
    None when step 1 split exactly as a call with the same ``seen`` set did.
    """
    split = _split(units, cp, theta, style, seen)
    return None if split is None else _pack(units, *split)


def _split(units: _Units, cp: int, theta: float, style: str,
           seen: Optional[set] = None) -> Optional[Tuple["_Ranks", List[int]]]:
    """Step 1 of ``_split_and_pack``: the ranks after it and the units left whole (by_work order);
    None when it split exactly as a call with the same ``seen`` set did."""
    L = units.tokens // cp
    target = max(units.total / cp, 1e-9)
    ranks = _Ranks(cp, L)
    load, room = ranks.load, ranks.room
    # Only the heavy units are visited (the light ones only go whole); every unit not split then
    # goes whole, in by_work order. zigzag: which units are heavy is fixed by theta. need: it moves
    # as ranks fill (the limit, theta of the least loaded rank's missing work, only falls), so the
    # next heavy unit is looked up after each split (``next_heavy``) instead of testing every unit.
    split = set()
    if style == "need":
        order = units.splittable(L)[0]

        def heavy_units():
            k = -1
            while (k := units.next_heavy(k + 1, theta * max(target - min(load), 0.0), L)) is not None:
                yield order[k], 0  # m: from the ranks' loads when it is reached
        heavy = heavy_units()
    else:
        # zigzag: each heavy unit's m is fixed by theta, and the split is a function of the (unit, m)
        # sequence: one seen before split as that call did (its ranges are in ``seen``), so it is
        # not done again.
        starts, ends, works, share = units.start, units.end, units.work, min(theta, 1.0) * target
        heavy = [(i, min(cp, max(2, -((starts[i] - ends[i]) // L), math.ceil(works[i] / share - 1e-9))))
                 for i in units.heavy(theta * target, L)]
        if seen is not None:
            sequence = ("zigzag", tuple(heavy))
            if sequence in seen:
                return None
            seen.add(sequence)
    owned = ranks.owned
    for i, m in heavy:
        # Ranks picked by sorting (key, rank) tuples: a stable sort of range(cp) by key, without a
        # key function call per rank.
        if style == "need":
            n, w = units.end[i] - units.start[i], units.work[i]
            needs = sorted([(load[r] - target, -room[r], r) for r in range(cp)])
            m, covered = 0, 0.0
            while m < cp and (m < 2 or covered < w or m * L < n):
                covered += max(target - load[needs[m][2]], 0.0)
                m += 1
            chosen = sorted([r for _, _, r in needs[:m]], key=load.__getitem__)
        else:
            by_room = sorted([(-room[r], load[r], r) for r in range(cp)])
            chosen = sorted([r for _, _, r in by_room[:m]], key=load.__getitem__)
        halves = units.halves(i, m)
        for r, half in zip(chosen, halves):  # a loop, not any() over a generator: many short calls
            if room[r] < half[0]:
                break  # no room to split it: it goes whole, and step 3 cuts it where it lands
        else:
            split.add(i)
            for r, (size, head, head_work, tail, tail_work) in zip(chosen, halves):
                if head is not None:
                    owned[r].append(head)
                    load[r] += head_work
                if tail is not None:
                    owned[r].append(tail)
                    load[r] += tail_work
                room[r] -= size
    whole = [i for i in units.by_work if i not in split] if split else list(units.by_work)

    if seen is not None:
        key = tuple(tuple(o) for o in ranks.owned)
        if key in seen:
            return None
        seen.add(key)
    return ranks, whole


def _pack(units: _Units, ranks: "_Ranks", whole: Sequence[int]) -> Tuple[Owned, Owned]:
    """Steps 2-3 of ``_split_and_pack`` after ``_split`` (``ranks`` filled in place), one packing in
    Python (``_pack_lockstep``: many at once)."""
    cp, L = len(ranks.room), units.tokens // len(ranks.room)
    target = max(units.total / cp, 1e-9)
    load, room = ranks.load, ranks.room
    # Step 2, two ways: whole units strictly where they fit (the rest cut in), or binned and streamed.
    strict = ranks.copy()
    _fill(strict, units, whole)
    # Step 2: a heap on the current key (ties by rank) instead of a scan of every rank per unit.
    bins: List[List[int]] = [[] for _ in range(cp)]
    tokens = [L - r for r in room]
    work = list(load)
    heap = [(max(work[r] / target, tokens[r] / L), r) for r in range(cp)]
    heapq.heapify(heap)
    lengths, works, replace = units.length, units.work, heapq.heapreplace
    for i in whole:
        r = heap[0][1]
        bins[r].append(i)
        t = tokens[r] = tokens[r] + lengths[i]
        x = work[r] = work[r] + works[i]
        x, t = x / target, t / L
        replace(heap, (t if t > x else x, r))  # max(x, t)
    # Within a bin, longest first (a stable sort: ties keep their by_work order).
    neg_len, ranges = units.neg_len.__getitem__, units.range
    ranks.cut_in([ranges[i] for b in bins for i in sorted(b, key=neg_len)])
    return ranks.owned, strict.owned


def _fill(ranks: "_Ranks", units: "_Units", order: Sequence[int]) -> None:
    """Whole units in ``order`` to the least loaded rank that has room (ties by rank); the rest cut
    into the ranks' free tokens, least loaded first."""
    room, owned, load = ranks.room, ranks.owned, ranks.load
    # The ranks with room by (load, rank), kept sorted (not a heap): most units do not fit the least
    # loaded rank, and the first with room among the four least loaded is then a slice, not a sort.
    ranked = sorted((load[r], r) for r in range(len(room)) if room[r] > 0)
    rest = []
    ranges, lengths, works, insort = units.range, units.length, units.work, bisect.insort
    for i in order:
        n = lengths[i]
        for k, (_, r) in enumerate(ranked[:4]):
            if room[r] >= n:
                break
        else:
            rest.append(ranges[i])
            continue
        owned[r].append(ranges[i])
        room[r] -= n
        load[r] += works[i]
        del ranked[k]
        if room[r] > 0:
            insort(ranked, (load[r], r))
    ranks.cut_in(rest, order=sorted(range(len(room)), key=load.__getitem__))


def _pack_lockstep(jobs: Sequence[Tuple[_Units, "_Ranks", Sequence[int]]], cp: int) -> List[Tuple[Flat, Flat]]:
    """``_pack`` of J packings at once (``_split``'s results), each as (rank, a, b) arrays in the order
    ``_pack``'s lists hold them: both greedy steps 2 walk the J packings' t-th whole units together as
    [J, cp] numpy arrays (one step per unit, not per (packing, unit)), the same float sums in the
    same order (bit-identical), and step 3's cuts are binary searches. A packing with fewer units
    steps through zeros, which change nothing."""
    J = len(jobs)
    S = max(len(whole) for _, _, whole in jobs)
    start, length = np.zeros((J, S), dtype=np.int64), np.zeros((J, S), dtype=np.int64)
    work, valid = np.zeros((J, S)), np.zeros((J, S), dtype=bool)
    for j, (u, _, whole) in enumerate(jobs):
        idx = np.array(whole, dtype=np.int64)
        u_start, u_length, u_work = u.arrays()
        start[j, :idx.size], length[j, :idx.size], work[j, :idx.size] = u_start[idx], u_length[idx], u_work[idx]
        valid[j, :idx.size] = True
    room0 = np.array([r.room for _, r, _ in jobs], dtype=np.int64).ravel()  # [J * cp]: flat rank j * cp + r
    load0 = np.array([r.load for _, r, _ in jobs], dtype=np.float64).ravel()
    L = np.array([u.tokens // cp for u, _, _ in jobs], dtype=np.int64)
    target = np.array([max(u.total / cp, 1e-9) for u, _, _ in jobs])
    jrow, base = np.arange(J), np.arange(J) * cp
    # Step 2 strictly (``_fill``): per unit, the first with room among the (up to) four least loaded
    # ranks with room, by (load, rank): a stable argsort of the loads, full ranks at inf. A rank with
    # room n >= 1 has room, so the four need no other test.
    room, load = room0.copy(), load0.copy()
    ranked = np.where(room > 0, load, np.inf)
    by_load = ranked.reshape(J, cp)  # a view
    lengths, works = length.T.copy(), work.T.copy()  # [S, J]: each step's row contiguous
    placed = np.empty((S, J), dtype=np.int64)  # flat rank, or -1: cut in afterwards
    for t in range(S):
        n = lengths[t]
        four = by_load.argsort(1, kind="stable")[:, :4]
        four += base[:, None]
        fits = room[four] >= n[:, None]
        k = fits.argmax(1)
        r = four[jrow, k]
        has = fits[jrow, k]
        left = room[r] - n * has
        room[r] = left
        x = load[r] + works[t] * has
        load[r] = x
        x[left == 0] = np.inf
        ranked[r] = x
        r[~has] = -1
        placed[t] = r
    # Step 2 streamed: per unit, the rank of the least max(work / share, tokens / L) (ties: the lower).
    tokens, streamed = np.repeat(L, cp) - room0, load0.copy()
    key = np.maximum(streamed / np.repeat(target, cp), tokens / np.repeat(L, cp))
    by_key = key.reshape(J, cp)  # a view
    binned = np.empty((S, J), dtype=np.int64)
    for t in range(S):
        r = by_key.argmin(1)
        r += base
        binned[t] = r
        x = tokens[r] + lengths[t]
        tokens[r] = x
        y = streamed[r] + works[t]
        streamed[r] = y
        key[r] = np.maximum(y / target, x / L)
    placed, binned = placed.T, binned.T
    # Step 3, streamed: each rank's bin longest first (ties in by_work order), ranks in order, cut into
    # their room; strictly: the units left over, cut into the room left, least loaded rank first.
    j_of, t_of = np.nonzero(valid)  # job-major
    s_a, s_n, s_bin = start[j_of, t_of], length[j_of, t_of], binned[j_of, t_of]
    order = np.argsort(s_bin * (int(s_n.max(initial=0)) + 1) - s_n, kind="stable")  # flat bins: job-major
    stream = _stream_cut(s_a[order], s_n[order], np.arange(J * cp), room0)
    left = placed[j_of, t_of] < 0
    rest = _stream_cut(s_a[left], s_n[left], (np.argsort(load.reshape(J, cp), axis=1, kind="stable")
                                              + base[:, None]).ravel(), room)
    # Per packing, step 1's ranges, then (strict) the units placed whole in order, then the cuts.
    per_rank = [spans for _, ranks, _ in jobs for spans in ranks.owned]
    ab = np.fromiter(chain.from_iterable(chain.from_iterable(per_rank)), dtype=np.int64).reshape(-1, 2)
    first = (repeat_arange(np.fromiter(map(len, per_rank), dtype=np.int64, count=len(per_rank))), ab[:, 0], ab[:, 1])
    whole_kept = ~left
    p_a = s_a[whole_kept]
    strict = _by_rank(J, cp, first, (placed[j_of, t_of][whole_kept], p_a, p_a + s_n[whole_kept]), rest)
    streamed_out = _by_rank(J, cp, first, stream)
    return [(streamed_out[j], strict[j]) for j in range(J)]


def _stream_cut(a: np.ndarray, n: np.ndarray, order: np.ndarray, room: np.ndarray
                ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``_Ranks.cut_in`` of many packings at once: the ranges [a, a + n) (packing-major, each packing's
    tokens its ranks' room) laid end to end and cut into the flat ranks ``order`` (packing-major,
    each packing's ranks in its fill order) at their ``room``: (flat rank, a, b) per piece, in order."""
    cap = room[order]
    first = np.cumsum(cap) - cap  # each rank's first token in the stream of every packing's ranges
    end = np.cumsum(n)
    begin = end - n
    which, slot = _pieces_np(begin, end, first)  # a full rank's equal start: the next rank's is found
    lo = np.maximum(begin[which], first[slot])
    hi = np.minimum(end[which], first[slot] + cap[slot])
    keep = hi > lo  # a full rank inside a range gets nothing
    which, slot, lo, hi = which[keep], slot[keep], lo[keep], hi[keep]
    shift = a[which] - begin[which]
    return order[slot], lo + shift, hi + shift


def _by_rank(J: int, cp: int, *parts: Tuple[np.ndarray, np.ndarray, np.ndarray]) -> List[Flat]:
    """Ranges (flat rank j * cp + r, a, b) from ``parts`` in turn, per packing j: (rank, a, b) by rank,
    each rank's in the order given."""
    rank, a, b = (np.concatenate(x) for x in zip(*parts))
    order = np.argsort(rank, kind="stable")
    rank, a, b = rank[order], a[order], b[order]
    cuts = np.searchsorted(rank, np.arange(J + 1) * cp).tolist()
    rank %= cp
    return [(rank[lo:hi], a[lo:hi], b[lo:hi]) for lo, hi in zip(cuts[:-1], cuts[1:])]


__all__ = ["balanced_runs", "BALANCE_GOAL", "SPLIT_THRESHOLDS"]

