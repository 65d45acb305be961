"""The received keys as a few steps of every source: a kernel call per band, not per source.

``HierarchicalTransport`` delivers every needed row at once, and ``WholeNeededTransport`` (a2a /
halo with the received K/V kept, where ``BlockDiagCPState.needed_whole`` says so) piece g of every
source together for step g (``groups``: each source's rows cut into that many pieces, one for a
single step). Attending such a step source by source (``chunks``: up to two calls per source
piece) buys no overlap, only calls, query gathers and float32 merges. Here the step's rows are
attended by *band* instead:

    one document on this rank, local pieces P0 < P1 (zigzag's two halves, THD's two chunks):

        positions   [ds ........ | P0 | ........ | P1 | ...
                      band 0       own   band 1    own
                      remote             remote

    band i: the remote positions with i local pieces of their document before them;
    every piece from Pi on sees all of band i, and every key of it precedes them (full)

    call i: per document with keys in band i, one segment: queries Pi .. Pk over band i

so a document with k local pieces has k bands, and the step has as many calls as the most
pieces a document has on this rank (two for zigzag and THD), a band whose query rows fall in
two runs one per run (``chunks.RUN_CALLS``). Every received row lies in one band, every query row in
at most one segment of a call.

The buffer the routes fill is reordered to match (``GatheredPlan.order``: the routes place each
row where the plan reads it, so the reorder costs no copy): band 0 of every document in
position order, then band 1, ... Each call's keys are then one run of the buffer, read in place.
With groups, each step's buffer is ordered so, one after the other (``GatheredPlan.starts``).

One row of doc ids (R = 1) and no sliding window: a windowed segment sees a band of positions
its own pieces cut, and several rows of ids interleave their keys in the buffer; those keep
``chunks``' plan.
"""

from dataclasses import dataclass, replace
from typing import Optional, Sequence, Tuple

import numpy as np
import torch

from .chunks import CallPlan, Step, StreamPlan, _pieces, calls_by_runs
from .exchange import Pieces
from .intervals import DocRuns, RankRuns, np64, ranges_np


@dataclass(frozen=True)
class GatheredPlan:
    """The band steps' plan and the buffer order they read."""

    stream: StreamPlan  # the own step, then one step per group of pieces (if any step moves rows)
    order: np.ndarray  # [received] for each row of the groups' buffers, one after the other, its row in the
    #                    needed-only one
    starts: Tuple[int, ...] = (0,)  # where each group's buffer starts in ``order``

    def band_of(self) -> np.ndarray:
        """[received] for each row of the needed-only buffer, its row in this plan's order (``order``'s inverse)."""
        band_of = np.empty_like(self.order)
        band_of[self.order] = np.arange(self.order.size)
        return band_of

    def route(self, route):
        """``hierarchy.HierarchicalRoute`` with its received rows placed in this plan's order (host)."""
        L = route.local_len
        new_of_old = self.band_of()

        def placed(slots: torch.Tensor) -> torch.Tensor:
            s = slots.numpy().copy()
            received = s >= L  # the local rows and slot1's -1 (fetched for the node only) stay
            s[received] = L + new_of_old[s[received] - L]
            return torch.from_numpy(s)

        return replace(route, slot1=placed(route.slot1), slot2=placed(route.slot2), kept1_slot=placed(route.kept1_slot))


def _band_calls(q_rows: np.ndarray, q_lens: np.ndarray, k_lens: np.ndarray, k_first: int):
    """One band's calls: its segments (query rows ``q_rows`` cut by ``q_lens``, keys the buffer's rows from
    ``k_first`` cut by ``k_lens``) in one call, cut where the query rows break into runs
    (``chunks.calls_by_runs``): a call per run, each reading its rows in place, where there are few."""
    whole = CallPlan(False, torch.from_numpy(q_rows), torch.arange(k_first, k_first + int(k_lens.sum())),
                     tuple(q_lens.tolist()), tuple(k_lens.tolist()))
    return list(calls_by_runs(whole))


def gathered_stream_plan(needed: StreamPlan, runs: RankRuns, rows: Sequence[DocRuns],
                         recv_positions: Sequence[torch.Tensor], groups: int = 1) -> Optional[GatheredPlan]:
    """The band plan for ``needed`` (``chunks``' plan of the same rank, no window), or None where it does
    not apply: several rows of doc ids, or pieces out of position order.

    ``groups`` steps after the own one (the same on every rank): each source's rows (ascending positions)
    are cut into that many pieces (``exchange.Pieces``), and step g reads piece g of every source."""
    rank, cp, L = needed.rank, needed.cp, needed.local_len
    if needed.rows != 1 or len(rows) != 1:
        return None
    own = needed.steps[0]
    if len(needed.steps) == 1:  # nothing moves on any rank (the steps are global)
        return GatheredPlan(needed, np.zeros(0, dtype=np.int64))
    by_source = [np64(recv_positions[s]) for s in range(cp) if s != rank]
    pos = np.concatenate(by_source or [np.zeros(0, np.int64)])
    cut = Pieces(parts=groups)
    pieces = None
    if pos.size:
        pieces = _pieces(runs, rows, rank)
        pa_p, pb_p = pieces[3], pieces[4]
        if pa_p.size > 1 and not (pa_p[1:] >= pb_p[:-1]).all():
            return None
    first_row = np.cumsum([0] + [p.size for p in by_source])
    steps, order, starts = [own], [], []
    for g in range(groups):
        # needed-only rows of group g: piece g of every source, source after source
        rows_g = np.concatenate([first_row[s] + np.arange(*_first_last(cut.span(p.size, g)))
                                 for s, p in enumerate(by_source)] or [np.zeros(0, np.int64)])
        calls, order_g = _band_step(pieces, np64(rows[0][0]), pos[rows_g]) if rows_g.size else ((), rows_g)
        starts.append(sum(o.size for o in order))
        order.append(rows_g[order_g])
        steps.append(Step(1, g, -1, 0, int(rows_g.size), tuple(calls)))
    chunk_rows = max(1, max(step.chunk_len for step in steps[1:]))
    return GatheredPlan(StreamPlan(needed.kind, rank, cp, 1, L, chunk_rows, tuple(steps)), np.concatenate(order),
                        tuple(starts))


def _first_last(span):
    first, n = span
    return first, first + n


def _band_step(pieces, doc_starts: np.ndarray, pos: np.ndarray):
    """One band step over the received positions ``pos`` (this rank's ``_pieces``, the documents' first
    positions ``doc_starts``): its calls, and for each row of its buffer (band, then document, then
    position) the row of ``pos`` it holds."""
    _, doc_p, _, pa_p, pb_p, q_first = pieces
    n_q = pb_p - pa_p
    doc_x = doc_starts.searchsorted(pos, side="right") - 1  # [received] its document
    first = doc_p.searchsorted(doc_x, side="left")  # its document's first local piece
    band = pa_p.searchsorted(pos, side="right") - first  # local pieces of its document before it
    if (first + band >= doc_p.searchsorted(doc_x, side="right")).any():
        raise RuntimeError("blockdiag-cp: a received row precedes no local query of its document; "
                           "the needed-only exchange and the pieces disagree")
    order = np.lexsort((pos, doc_x, band))  # band, then document, then position
    band_sorted, doc_sorted = band[order], doc_x[order]
    edges = np.flatnonzero(np.diff(band_sorted)) + 1
    calls = []
    for lo, hi in zip(np.r_[0, edges], np.r_[edges, pos.size]):
        i = int(band_sorted[lo])
        docs, k_lens = np.unique(doc_sorted[lo:hi], return_counts=True)  # ascending documents
        p0 = doc_p.searchsorted(docs, side="left") + i
        n_pieces = doc_p.searchsorted(docs, side="right") - p0  # >= 1: Pi .. Pk
        piece = ranges_np(p0, n_pieces)
        q_lens = np.add.reduceat(n_q[piece], np.cumsum(n_pieces) - n_pieces)
        calls += _band_calls(ranges_np(q_first[piece], n_q[piece]), q_lens, k_lens, int(lo))
    return calls, order


__all__ = ["GatheredPlan", "gathered_stream_plan"]
