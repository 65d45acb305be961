"""TransformerEngine's THD layout (per-document DualChunkSwap) and the closed forms of its plan tables.

``THDLayout`` cuts every padded document into 2 * cp chunks. Its boundaries
(``thd_boundaries``, ``thd_padded_cu_seqlens``) come from the batch or the doc
ids; ``thd_partitioned_indices`` is TE's ``thd_get_partitioned_indices``. For one
row of full attention the plan's tables have closed forms over the documents
(``thd_extents`` and the ``thd_*`` functions after it), which ``THDLayout.plan_tables``
gives the plan (``THDTables``) in place of the generic interval arithmetic.
"""

from functools import lru_cache
from typing import Optional, Sequence, Tuple

import numpy as np
import torch

from ..intervals import DocRuns, document_runs
from .base import Layout, LayoutStrategy, LayoutTables, RunSpec


class THDLayout(LayoutStrategy):
    """TransformerEngine's THD DualChunkSwap partition, per document.

    Every padded document of length Lp (a multiple of 2*cp) is cut into 2*cp
    chunks of Lp / (2*cp); rank r owns chunks r and 2*cp-1-r of every document,
    documents in order. cp = 2, documents A (8 positions) and B (8):

        A: | 0 0 | 1 1 | 1 1 | 0 0 |   B: | 0 0 | 1 1 | 1 1 | 0 0 |
        rank 0: A0 A1 A6 A7 B0 B1 B6 B7   (= thd_partitioned_indices([0, 8, 16], 16, 2, 0))

    The padded extents are the batch's own (``cu_seqlens_padded``, what TE's
    partition cut: an empty document's padding is an extent of its own) or, from
    doc ids alone, run from a document's first token to the next document's first
    token: THD pads every document at its end. One row of doc ids only.
    """

    name = "thd"

    @staticmethod
    def granularity(cp: int) -> int:
        return 2 * cp if cp > 1 else cp

    def runs(self, doc_ids, cp, cost_model, windows=None, doc_runs=None):
        return self.chunk_runs(thd_boundaries(doc_ids, cp, doc_runs).numpy(), cp)

    def plan_tables(self, layout: Layout, doc_ids: torch.Tensor, rows: Sequence[DocRuns],
                    window: Optional[int]) -> LayoutTables:
        # The closed forms count one row of whole documents; several rows or a window: the intervals.
        if doc_ids.shape[0] == 1 and layout.cp > 1 and window is None:
            return THDTables(layout, doc_ids, rows)
        return super().plan_tables(layout, doc_ids, rows, window)

    @staticmethod
    def chunk_runs(cu: np.ndarray, cp: int) -> RunSpec:
        """(rank, start, length) of the chunks of the padded documents [cu[i], cu[i + 1]), none empty."""
        # In numpy: 2 * cp runs per document, at a half to a third of torch's op costs on one core.
        # Runs that touch come merged, as RankRuns.build would merge them (its merge made three more
        # arrays of every run, ~5 ms of a 1M / cp 64 plan): rank cp - 1's two chunks of a document,
        # rank 0's last chunk of a document and its first of the next. Each array is written once.
        chunk = np.diff(cu) // (2 * cp)  # [n]
        n = chunk.size
        mid = 2 * n * (cp - 2)  # ranks 1 .. cp - 2: [cp - 2, n, 2] runs
        start, length = np.empty(n + 1 + mid + n, dtype=np.int64), np.empty(n + 1 + mid + n, dtype=np.int64)
        start[0], start[1:n], start[n] = 0, cu[1:-1] - chunk[:-1], cu[-1] - chunk[-1]  # rank 0: n + 1 runs
        length[0], length[n] = chunk[0], chunk[-1]
        np.add(chunk[:-1], chunk[1:], out=length[1:n])
        rank = np.arange(1, cp - 1).reshape(-1, 1)
        s_mid, l_mid = (x[n + 1:n + 1 + mid].reshape(cp - 2, n, 2) for x in (start, length))
        for k, first in enumerate((rank, 2 * cp - 1 - rank)):  # chunks r and 2cp-1-r, a [cp - 2, n] view each
            # (a view per chunk: numpy's loops over a last axis of 2 cost several times more)
            np.multiply(first, chunk, out=s_mid[:, :, k])
            s_mid[:, :, k] += cu[:-1]
            l_mid[:, :, k] = chunk
        np.multiply(chunk, cp - 1, out=start[n + 1 + mid:])  # rank cp - 1: chunks cp - 1 and cp, one run
        start[n + 1 + mid:] += cu[:-1]
        np.multiply(chunk, 2, out=length[n + 1 + mid:])
        count = np.full(cp, 2 * n)
        count[0], count[-1] = n + 1, n
        return torch.from_numpy(np.repeat(np.arange(cp), count)), torch.from_numpy(start), torch.from_numpy(length)


def thd_boundaries(doc_ids: torch.Tensor, cp: int, doc_runs=None, cu_seqlens_padded=None) -> torch.Tensor:
    """[n + 1] int64 padded document boundaries of the ``thd`` layout, checked at cp, empty extents dropped.

    doc_ids: [1, P]; ``doc_runs``: its rows' ``intervals.document_runs`` (or None);
    ``cu_seqlens_padded``: the batch's own boundaries (None: ``thd_padded_cu_seqlens`` of the ids).
    """
    if doc_ids.shape[0] != 1:
        raise ValueError(f"layout 'thd' takes one row of doc ids (THD packs the batch into one "
                         f"sequence), got {doc_ids.shape[0]} rows; pass doc_ids of shape [S] or "
                         f"use another layout for per-row documents")
    row_runs = None if doc_runs is None else doc_runs[0]
    if cu_seqlens_padded is None:
        return thd_padded_cu_seqlens(doc_ids[0], cp, row_runs)
    cu = torch.as_tensor(cu_seqlens_padded).reshape(-1).to("cpu", torch.int64).numpy()
    P = doc_ids.shape[-1]
    if cu.size < 2 or cu[0] != 0 or cu[-1] != P or (np.diff(cu) < 0).any():
        raise ValueError(f"layout 'thd': cu_seqlens_padded {_short_list(cu)} must start at 0, not "
                         f"decrease and end at the padded length {P}")
    # An extent of 0 holds no token: TE's partition skips it, and so do the chunks.
    keep = np.ones(cu.size, dtype=bool)
    keep[1:] = cu[1:] != cu[:-1]
    cu = _checked_thd_cu(cu[keep], doc_ids[0], cp)
    d_start, d_end, d_id = (x.numpy() for x in (document_runs(doc_ids[0]) if row_runs is None else row_runs))
    real = d_id > 0
    # The closed forms read every document as its extent's head: it starts at a boundary and ends
    # inside that extent.
    at = np.searchsorted(cu, d_start[real], side="right") - 1
    bad = np.flatnonzero((cu[at] != d_start[real]) | (d_end[real] > cu[at + 1]))
    if bad.size:
        i = int(bad[0])
        a, b = int(d_start[real][i]), int(d_end[real][i])
        raise ValueError(f"layout 'thd': the document at positions {a}..{b - 1} does not start a padded "
                         f"extent of cu_seqlens_padded {_short_list(cu)} or crosses its end; every "
                         f"document must start its extent, padding after it")
    return torch.from_numpy(cu)


def _short_list(values: np.ndarray) -> str:
    v = [int(x) for x in values]
    return str(v) if len(v) <= 8 else f"[{v[0]}, {v[1]}, ..., {v[-1]}] ({len(v)})"


def thd_padded_cu_seqlens(doc_ids: torch.Tensor, cp: int, doc_runs: Optional[DocRuns] = None) -> torch.Tensor:
    """[n + 1] padded document boundaries from one row of doc ids, checked for THD at cp.

    A boundary sits at every start of a nonzero run (and at 0): padding after a
    document belongs to that document's padded extent. ``doc_runs``: the row's
    ``intervals.document_runs``, when the caller has them (no other pass over the ids).
    """
    d_start, _, d_id = document_runs(doc_ids) if doc_runs is None else doc_runs
    # In numpy: a THD plan makes these twice (its layout, its extents), each a few small torch ops.
    d_start, d_id = d_start.numpy(), d_id.numpy()
    cu = np.concatenate((np.zeros(1, dtype=np.int64), d_start[1:][d_id[1:] > 0],
                         np.full(1, doc_ids.numel(), dtype=np.int64)))
    return torch.from_numpy(_checked_thd_cu(cu, doc_ids, cp))


def _checked_thd_cu(cu: np.ndarray, doc_ids: torch.Tensor, cp: int) -> np.ndarray:
    """cu, or the error naming the first document whose padded extent is not a multiple of 2*cp."""
    extent = cu[1:] - cu[:-1]
    bad = (extent % (2 * cp)).nonzero()[0]
    if bad.size:
        i = int(bad[0])
        doc = int(doc_ids[int(cu[i])])
        what = f"document {doc}" if doc else "a padding-only extent"
        raise ValueError(
            f"layout 'thd' at cp={cp}: {what} (positions {int(cu[i])}..{int(cu[i + 1]) - 1}) "
            f"has padded extent {int(extent[i])}, not a multiple of 2*cp = {2 * cp}; pad every "
            f"document at its end to a multiple of {2 * cp} (THD's cu_seqlens_padded), or use "
            f"another layout")
    return cu


def thd_partitioned_indices(cu_seqlens_padded, total_tokens: int, cp: int, rank: int) -> torch.Tensor:
    """Global token indices of ``rank``'s share, as TE's ``thd_get_partitioned_indices``.

    cu_seqlens_padded: [n + 1] padded document boundaries, each a multiple of 2*cp.
    Returns [total_tokens / cp] int64: for every document, its chunks ``rank`` and
    ``2*cp - 1 - rank`` of 2*cp equal chunks. Pure torch, any device.
    """
    cu = torch.as_tensor(cu_seqlens_padded).reshape(-1).to(torch.int64)
    if cu.numel() < 2 or int(cu[0]) != 0 or bool((cu.diff() < 0).any()):
        raise ValueError(f"cu_seqlens_padded must start at 0 and not decrease, got {cu.tolist()}")
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"thd_partitioned_indices: need cp >= 1 and 0 <= rank < cp, got cp={cp}, rank={rank}")
    if bool((cu % (2 * cp)).any()):
        raise ValueError(f"cu_seqlens_padded {cu.tolist()} must be multiples of 2*cp = {2 * cp} "
                         "(pad every document to a multiple of 2*cp)")
    if total_tokens % cp:
        raise ValueError(f"total_tokens {total_tokens} must be a multiple of cp = {cp}")
    local = cu // cp  # [n + 1] boundaries in one rank's share
    token = torch.arange(total_tokens // cp, device=cu.device)
    # TE's binary search: the last document whose local start <= token (tokens past the end stay in it).
    seq = torch.searchsorted(local[1:], token, right=True).clamp(max=cu.numel() - 2)
    half = (local[seq + 1] - local[seq]) // 2
    index = token - local[seq]
    chunk = torch.where(index < half, torch.full_like(index, rank), torch.full_like(index, 2 * cp - 1 - rank))
    return index + local[seq] * cp + half * (chunk - (index >= half).long())


def thd_extents(doc_ids: torch.Tensor, cp: int, doc_runs=None, cu_seqlens_padded=None
                ) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(cu [n + 1], c [n], run [n], real [n]) of one THD row: the padded documents' bounds, their chunk
    length, the document run holding each one's start (its index in ``doc_runs``, the row's
    ``intervals.document_runs``) and its real tokens (a document starts its extent; 0 for a
    padding-only extent). ``cu_seqlens_padded``: the layout's bounds (``Layout.cu_seqlens_padded``;
    None: ``thd_padded_cu_seqlens`` of the ids). What the closed forms below read, made once per plan."""
    row = doc_ids.reshape(-1)
    doc_runs = document_runs(row) if doc_runs is None else doc_runs
    cu = (thd_padded_cu_seqlens(row, cp, doc_runs) if cu_seqlens_padded is None
          else torch.as_tensor(cu_seqlens_padded)).numpy()
    c = np.diff(cu) // (2 * cp)  # [n]
    d_start, d_end, d_id = (x.numpy() for x in doc_runs)
    # The run holding each extent's start: a document's own run, or the padding an empty document's
    # extent lies in.
    which = np.searchsorted(d_start, cu[:-1], side="right") - 1
    real = np.where(d_id[which] > 0, np.minimum(d_end[which], cu[1:]) - cu[:-1], 0)
    return cu, c, which, real


def thd_exchange_counts(doc_ids: torch.Tensor, cp: int, doc_runs=None, extents=None) -> torch.Tensor:
    """counts[src, dst] of the THD layout in closed form (one row of doc ids, padded for THD).

    Every padded document is cut into 2*cp chunks of c tokens; its real tokens
    fill the first K chunks, the last one with f tokens. Rank r's queries in it
    need [start, end of its last real chunk) (its chunk 2*cp-1-r if real, else
    chunk r), so what src sends dst is c * A_K[src, dst] + f * B_K[src, dst],
    with A_K, B_K fixed by K alone: the sum over documents is a sum over K of
    the documents' c and f. Equals the generic interval count
    (``intervals.overlap_counts``) at O(documents + cp^3) instead of
    O(documents * cp^2). ``doc_runs``: the row's ``intervals.document_runs``, when the caller has them;
    ``extents``: its ``thd_extents``.
    """
    # In numpy (a few ops per document): a half to a third of torch's op costs on one core.
    _, c, _, real = thd_extents(doc_ids, cp, doc_runs) if extents is None else extents
    has = real > 0
    c, real = c[has], real[has]
    K = (real + c - 1) // c  # chunks holding real tokens, 1..2cp
    f = real - (K - 1) * c  # real tokens of the last of them
    A, B = _thd_patterns(cp)  # [2cp, cp, cp] each, row K - 1
    # Float64 sums of integers far below 2**53: exact, whatever the order.
    by_k = [np.bincount(K - 1, weights=x, minlength=2 * cp) for x in (c, f)]
    counts = by_k[0] @ A.numpy().reshape(2 * cp, -1) + by_k[1] @ B.numpy().reshape(2 * cp, -1)
    return torch.from_numpy(np.rint(counts).astype(np.int64).reshape(cp, cp))


def thd_work_and_intervals(extents, cp: int
                           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``intervals.work_intervals_and_docs`` of the THD layout (one row, full attention) in closed form:
    (work [cp], dst, a, b, doc), intervals sorted by (dst, a); ``extents``: the row's ``thd_extents``.

    Rank r's queries in a padded document [u, u + 2cp c) with real tokens [u, u + m) are its chunks
    r and 2cp-1-r cut at u + m: query u + x sees x + 1 keys, and it needs [u, end of its last real
    query). O(cp * documents) on [cp, documents] tables, instead of clipping the layout's 2cp runs per
    document against the documents (~14 ms of a 1M / cp 64 plan, its runs and pieces fresh memory).
    """
    cu, c, which, real = extents
    r = np.arange(cp).reshape(cp, 1)

    def real_queries(chunk: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """[cp, n] each: every rank's real queries [x0, x1) of its chunk ``chunk`` (x1 = x0: none)."""
        x0 = chunk * c
        x1 = np.minimum(x0 + c, real)
        return x0, np.maximum(x1, x0, out=x1)

    head, tail = real_queries(r), real_queries(2 * cp - 1 - r)
    work = np.zeros(cp, dtype=np.int64)
    for x0, x1 in (head, tail):  # queries [x0, x1) see x0 + 1 .. x1 keys: (x0 + 1 + x1) (x1 - x0) / 2 pairs
        pairs = x0 + x1
        pairs += 1
        pairs *= x1 - x0
        pairs //= 2
        work += pairs.sum(1)
    # A rank's tail chunk has a real query only if its head chunk has; the interval ends at its last.
    cell = np.flatnonzero(head[1] > head[0])  # rank-major, documents ascending
    end = np.where(tail[1] > tail[0], tail[1], head[1]).reshape(-1)[cell]
    dst, i = np.divmod(cell, c.size)
    a = cu[i]
    return (torch.from_numpy(work), torch.from_numpy(dst), torch.from_numpy(a), torch.from_numpy(a + end),
            torch.from_numpy(which[i]))


def thd_send_ranges(extents, cp: int, src: int, a: torch.Tensor, b: torch.Tensor, doc: torch.Tensor
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``intervals.flat_ranges`` of one source under THD in closed form: (lo, hi) [n], the flat index range
    of src's positions in each [a, b), for ranges that start at a padded document's start (``doc``: its
    document run) and end inside it, as needed intervals do; ``extents``: the row's ``thd_extents``.
    src owns a / cp positions before the document and of its own its chunks src and 2cp-1-src: no
    search per range.
    """
    cu, c, which, _ = extents
    chunk = np.zeros(int(which[-1]) + 1, dtype=np.int64)  # by document run: the runs holding extents' starts
    chunk[which] = c  # padding runs holding several empty extents' starts: no range reads them
    c = chunk[doc.numpy()]  # [n] the chunk length of each range's document
    qa = a.numpy()
    y = b.numpy() - qa  # [n] the range's length
    lo = qa // cp
    lo += src * (int(cu[-1]) // cp)
    hi = lo.copy()
    for first in (src, 2 * cp - 1 - src):  # src's positions in its chunks, in place
        part = c * first
        np.subtract(y, part, out=part)
        np.maximum(part, 0, out=part)
        hi += np.minimum(part, c, out=part)
    return torch.from_numpy(lo), torch.from_numpy(hi)


def thd_owned_ranges(extents, cp: int, a: torch.Tensor, b: torch.Tensor, skip: int
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``intervals.owned_ranges`` of the THD layout in closed form, for ranges [a, b) that start at a padded
    document's start and end inside it (as needed intervals do): (lo, hi) [cp, n], and (src, start,
    length) every source's positions in them as pieces of its runs (source-major, by range, ascending;
    none of ``skip``); ``extents``: the row's ``thd_extents``.

    In a document a source's runs are its chunks r and 2cp-1-r, but rank cp - 1's, which touch: one
    run (rank 0's runs span documents, but a range inside one cuts them at its chunks). Every rank
    owns u / cp positions before the document at u, so lo = r * L + u / cp and hi adds the pieces.
    """
    cu = extents[0]
    qa, qb = a.numpy(), b.numpy()
    n = qa.size
    c = np.searchsorted(cu, qa, side="right")  # the next document's start, then the chunk length
    c = cu[c]
    c -= qa
    c //= 2 * cp
    r = np.arange(cp).reshape(cp, 1)
    # [cp, n] tables per chunk, documents on the last axis: numpy's loops over a last axis of 2 (a
    # [cp, n, 2] table) cost several times more.
    starts, lengths = [], []
    for first in (r, 2 * cp - 1 - r):  # chunks r and 2cp-1-r: their starts, and lengths inside [a, b)
        start = first * c
        start += qa
        end = start + c
        starts.append(start)
        lengths.append(np.minimum(end, qb, out=end))
    lengths[0][cp - 1] = lengths[1][cp - 1]  # rank cp - 1: one run, its second chunk empty
    lengths[1][cp - 1] = starts[1][cp - 1]
    for start, length in zip(starts, lengths):
        length -= start
        np.maximum(length, 0, out=length)  # 0: the range ends before the chunk
    lo = r * (int(cu[-1]) // cp) + qa // cp
    hi = lo + lengths[0]
    hi += lengths[1]
    length = np.stack(lengths, 2)  # [cp, n, 2]: source-major, by range, ascending
    keep = length > 0
    keep[skip] = False
    cell = np.flatnonzero(keep)
    return (torch.from_numpy(lo), torch.from_numpy(hi), torch.from_numpy(cell // (2 * n)),
            torch.from_numpy(np.stack(starts, 2).reshape(-1)[cell]), torch.from_numpy(length.reshape(-1)[cell]))


class THDTables(LayoutTables):
    """``LayoutTables`` of the THD layout in closed form: one row of doc ids, full attention, cp > 1.

    Every table is read off the row's extents (``thd_extents``, made once per plan) instead of
    clipping its 2 * cp runs per document against the documents.
    """

    def __init__(self, layout: Layout, doc_ids: torch.Tensor, rows: Sequence[DocRuns]):
        super().__init__(layout, rows, None)
        self.cp, self.row_ids = layout.cp, doc_ids[0]
        self.extents = thd_extents(self.row_ids, self.cp, rows[0], layout.cu_seqlens_padded)

    def work_and_intervals(self):
        return thd_work_and_intervals(self.extents, self.cp)

    def exchange_counts(self, dst, a, b, known=None):
        # Every rank needs every document: the counts come by document, not by interval overlap.
        return thd_exchange_counts(self.row_ids, self.cp, self.rows[0], self.extents), None

    def send_ranges(self, src, a, b, doc):
        return thd_send_ranges(self.extents, self.cp, src, a, b, doc)

    def owned_ranges(self, a, b, skip):
        return thd_owned_ranges(self.extents, self.cp, a, b, skip)


@lru_cache(maxsize=8)
def _thd_patterns(cp: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """A_K, B_K of ``thd_exchange_counts`` for K = 1..2cp: [2cp, cp(src), cp(dst)] float64."""
    K = torch.arange(1, 2 * cp + 1).view(-1, 1, 1)
    src = torch.arange(cp).view(1, -1, 1)
    dst = torch.arange(cp).view(1, 1, -1)
    src_tail, dst_tail = 2 * cp - 1 - src, 2 * cp - 1 - dst
    # dst's last chunk with real tokens (-1: none): its tail chunk if real, else its head chunk.
    last = torch.where(dst_tail < K, dst_tail, torch.where(dst < K, dst, torch.full_like(dst, -1)))
    ends_partial = last == K - 1  # its interval ends inside the partial chunk K - 1
    full = torch.where(ends_partial, K - 2, last)  # full chunks [0, full] lie inside the interval
    A = ((src <= full).long() + (src_tail <= full).long()) * (last >= 0)
    B = ((src == K - 1).long() + (src_tail == K - 1).long()) * ends_partial
    own = (src == dst).expand_as(A)
    return A.masked_fill(own, 0).double(), B.masked_fill(own, 0).double()


__all__ = ["THDLayout", "THDTables", "thd_boundaries", "thd_padded_cu_seqlens", "thd_partitioned_indices",
           "thd_extents", "thd_exchange_counts", "thd_work_and_intervals", "thd_send_ranges", "thd_owned_ranges"]
