"""Scoring the balanced search's candidates: per rank, work and the K/V positions received and sent."""

from itertools import chain
from typing import Optional, Sequence, Tuple

import numpy as np
import torch

from ...intervals import (DocRuns, RankRuns, clip, expand_np, merge_intervals, overlap_counts, overlap_pieces,
                          repeat_arange, window_pairs, work_and_intervals)
from ..base import RunSpec
from .units import Owned, Units, UnitTable, pieces_np


def score_many(units: "Units", cp: int, q: float, cands: Sequence[Sequence[Tuple[str, Owned]]],
               exchange: Optional["NodeExchange"] = None):
    """The scores of several searches' candidates in one batch; per search (modeled, imbalance, flat).

    A search's imbalance is its work max over its own mean (its spans' share)."""
    sizes = [len(c) for c in cands]
    if sum(sizes) == 0:
        return [None] * len(cands)
    flat = flatten_np([owned for c in cands for _, owned in c], cp)
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


def rank_counts(table: UnitTable, ranks: int, flat, q: float) -> np.ndarray:
    """work + q * max(received, sent) [n_candidates, ranks], full attention, on ``flatten_np``'s arrays:
    the count the swap passes score (a rank, or a node as one rank)."""
    work, inn, out = _traffic_np(table, ranks, *flat)
    return work.astype(np.float64) + q * np.maximum(inn, out).astype(np.float64)


def flatten(owned_lists: Sequence, cp: int) -> Tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``flatten_np`` as tensors."""
    n, group, a, b = flatten_np(owned_lists, cp)
    return n, torch.from_numpy(group), torch.from_numpy(a), torch.from_numpy(b)


def flatten_np(owned_lists: Sequence, cp: int) -> Tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """Every candidate's ranges as flat int64 arrays, candidate-major: (count, candidate * cp + rank, a, b).
    A candidate: an ``Owned`` or ``pack_lockstep``'s (rank, a, b) arrays."""
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


def runs_of(c: int, cp: int, group: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> RunSpec:
    lo, hi = torch.searchsorted(group, torch.tensor([c * cp, (c + 1) * cp])).tolist()
    return group[lo:hi] - c * cp, a[lo:hi], b[lo:hi] - a[lo:hi]


def _mixed_scores(units, cp: int, flat, q: float, extra: Optional[np.ndarray] = None
                  ) -> Tuple[np.ndarray, np.ndarray]:
    """(modeled [n_candidates], work [n_candidates, cp]) under the table's window mix: per share of
    layers, the busiest rank's work + q * max(received, sent) (+ ``extra`` [n_candidates, cp], full
    attention only), weighed by the shares; work likewise. ``flat``: ``flatten_np``'s."""
    # In numpy (elementwise ops and a max, as torch's, without its dispatch per op on small arrays).
    modeled = np.zeros(flat[0])
    mixed = np.zeros((flat[0], cp))
    for window, share in units.windows.shares:
        if window is None and len(units.rows) == 1:
            work, inn, out = _traffic_np(units, cp, *flat)  # [all candidates, cp]
        else:
            n, group, a, b = flat
            traffic = candidate_traffic(units, cp, n, *(torch.from_numpy(x) for x in (group, a, b)), window=window)
            work, inn, out = (x.numpy() for x in traffic)
        rank = work.astype(np.float64) + q * np.maximum(inn, out).astype(np.float64)
        if extra is not None:
            rank = rank + extra
        modeled += share * rank.max(1)
        mixed += share * work.astype(np.float64)
    return modeled, mixed


def candidate_traffic(units, cp: int, n_cand: int, group: torch.Tensor, a: torch.Tensor,
                      b: torch.Tensor, window: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(work, received, sent) [n_candidates, cp] of every candidate at once (``units``: a ``Units``
    or the ``UnitTable``: only its rows of document runs and P are read); ``window``: of a layer
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
            runs = RankRuns.build(cp, units.P, *runs_of(c, cp, group, a, b))
            work, dst, ia, ib = work_and_intervals(runs, units.rows, window)
            counts = overlap_counts(runs, dst, ia, ib)
            out.append((work, counts.sum(0), counts.sum(1)))
        return tuple(torch.stack(x) for x in zip(*out))
    if window is not None:
        return _windowed_traffic(units.rows[0], units.P, cp, n_cand, group, a, b, window)
    return tuple(torch.from_numpy(x) for x in _traffic_np(units, cp, n_cand, group.numpy(), a.numpy(), b.numpy()))


def _traffic_np(units, cp: int, n_cand: int, group: np.ndarray, a: np.ndarray, b: np.ndarray
                ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``candidate_traffic`` of one row of ids, full attention, on ``flatten_np``'s arrays."""
    d_start, d_end, d_id = (x.numpy() for x in units.rows[0])
    n_docs = d_start.size
    # In numpy (a few dozen small array ops, each cheaper than torch's dispatch); sums by bincount's
    # float64 weights, exact: every partial sum is an integer far below 2**53.
    which, doc, pa, pb = real_pieces_np(a, b, d_start, d_end, d_id)
    starts = d_start
    g, s = group[which], starts[doc]
    size = n_cand * cp

    def total(index, values, n):
        return np.bincount(index, weights=values, minlength=n).astype(np.int64)

    work = total(g, (pa + pb - 2 * s + 1) * (pb - pa) // 2, size)
    key, inverse, reach, own, h_doc, h_group = document_holders(g, doc, pa, pb, n_docs, cp)
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
        p, h = expand_np(lo[pieces], (hi - lo)[pieces])
        p = pieces[p]
        sent = np.maximum(np.minimum(pb[p], reach[h]) - pa[p], 0)
        # Against every holder, its own among them (reach >= pb: pb - pa), taken off after the sums
        # (exact: integers) instead of a rank test per (piece, holder).
        out = total(g[p], sent, size) - total(g[pieces], (pb - pa)[pieces], size)
    return tuple(x.reshape(n_cand, cp) for x in (work, inn, out))


def real_pieces_np(a: np.ndarray, b: np.ndarray, d_start: np.ndarray, d_end: np.ndarray, d_id: np.ndarray
                   ) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``intervals._real_pieces`` of ``clip(a, b, d_start, d_end)`` in numpy only (range index, document,
    pa, pb; in range order): the search's ranges are a few thousand, where converting to and from
    torch cost as much as the two binary searches."""
    which, doc = pieces_np(a, b, d_start)
    real = d_id[doc] > 0
    if not real.all():
        which, doc = which[real], doc[real]
    return which, doc, np.maximum(a[which], d_start[doc]), np.minimum(b[which], d_end[doc])


def document_holders(g: np.ndarray, doc: np.ndarray, pa: np.ndarray, pb: np.ndarray, n_docs: int, cp: int):
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
    """``candidate_traffic`` of one row of ids by the plan's own rule, for any window (None: full).

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


class NodeExchange:
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

    def __init__(self, table: UnitTable, node_owned: Owned, g: int, q_inter: float):
        d_start, d_end, d_id = table.rows[0]
        nodes = len(node_owned)
        _, group, a, b = flatten_np([node_owned], nodes)
        starts = d_start.numpy()
        which, doc, pa, pb = real_pieces_np(a, b, starts, d_end.numpy(), d_id.numpy())
        # Holders: (document, node) -> reach and tokens owned; documents in position order.
        _, _, reach, own, h_doc, h_node = document_holders(group[which], doc, pa, pb, starts.size, nodes)
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
        (``group`` = candidate * g + rank, as ``flatten_np``; ``node_of``: each candidate's node)."""
        sent = self.sent_below(b) - self.sent_below(a)
        out = np.bincount(group, weights=sent, minlength=n_cand * self.g).reshape(n_cand, self.g)
        return self.q_inter * np.maximum(self.fetch[node_of], out)
