"""The streamed planner as it was before the vectorized call builder (issue 19 item 4), verbatim but for
one fix both builders carry (09308a2: a call holds a query row at most once); the transfer order
(``chunks.remote_steps`` and ``remote_step``, with the ring's ways and spans ``chunks.RingReach``) is imported,
not copied.

One change both builders carry since: without a window, a document's pieces that touch in local
storage take their own keys as one causal block (``chunks._joined_own_calls``).

Kept as the reference the new ``chunks.build_stream_plan`` must equal, field for field (every
step, call, index tensor and length), on random document ids: every layout, windows, several
rows, empty chunks and all-padding ranks. It materializes every call's query and key indices
per pair and cuts capped calls with Python loops over rows: at 1M tokens / cp 64 it took most
of a rank's plan time.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron_ext.blockdiag_cp.chunks import (CHUNK_KINDS, CallPlan, RingReach, Step, StreamPlan, chunk_rows_for,
                                              remote_step, remote_steps)
from megatron_ext.blockdiag_cp.intervals import DocRuns, RankRuns, clip, map_ranges, ranges


def _pieces(runs: RankRuns, rows: Sequence[DocRuns], rank: int):
    """This rank's real query pieces, in (row, position) order: row, doc, ds, pa, pb, q rows start."""
    mine = runs.of_rank(rank)
    r_start, r_len, r_local = runs.start[mine], runs.length[mine], runs.local[mine]
    parts = []
    for row, (d_start, d_end, d_id) in enumerate(rows):
        run, doc, pa, pb = clip(r_start, r_start + r_len, d_start, d_end)
        real = d_id[doc] > 0
        run, doc, pa, pb = run[real], doc[real], pa[real], pb[real]
        parts.append((torch.full_like(doc, row), doc, d_start[doc], pa, pb, r_local[run] + pa - r_start[run]))
    return [torch.cat(x) for x in zip(*parts)]


def _needed_offsets(runs: RankRuns, rank: int, dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    ds: torch.Tensor) -> torch.Tensor:
    """[cp, n] slot of position ds in each source's needed chunk for this rank.

    The chunk holds the source's positions inside this rank's needed intervals
    (sorted, disjoint), ascending: slot(x) = (source positions in earlier
    intervals) + (source positions in [a_j, x)) for the interval j holding x.
    """
    mine = dst == rank
    a, b = a[mine], b[mine]
    if a.numel() == 0:
        return torch.zeros(runs.cp, ds.numel(), dtype=torch.long)
    before_a = runs.flat_before(a)  # [cp, J]
    count = runs.flat_before(b) - before_a
    offset = torch.cumsum(count, 1) - count  # [cp, J]
    j = torch.searchsorted(a, ds, right=True) - 1  # every ds lies in one of this rank's intervals
    return offset[:, j] + runs.flat_before(ds) - before_a[:, j]


def _split_at_chunks(src, slot, n_k, piece, rank: int, chunk_rows: int):
    """Cut each (source, piece) key range at multiples of ``chunk_rows`` (not the own source's).

    Returns (source, chunk index, piece, slot, length) sorted by (source, chunk, piece).
    """
    if src.numel() == 0:
        return src, src, src, src, src
    remote = src != rank
    first = torch.where(remote, slot // chunk_rows, torch.zeros_like(slot))
    last = torch.where(remote, (slot + n_k - 1) // chunk_rows, torch.zeros_like(slot))
    count = last - first + 1
    which = torch.repeat_interleave(torch.arange(src.numel()), count)
    chunk = ranges(first, count)
    lo = torch.where(remote[which], torch.maximum(slot[which], chunk * chunk_rows), slot[which])
    hi = torch.where(remote[which], torch.minimum((slot + n_k)[which], (chunk + 1) * chunk_rows),
                     (slot + n_k)[which])
    order = torch.argsort((src[which] * (chunk.max() + 1) + chunk) * (piece.max() + 1) + piece[which])
    which, chunk, lo, hi = which[order], chunk[order], lo[order], hi[order]
    return src[which], chunk, piece[which], lo, hi - lo


def _group_calls(src: torch.Tensor, chunk: torch.Tensor, row: torch.Tensor, doc: torch.Tensor,
                 n_k: torch.Tensor, slot: torch.Tensor, q_first: torch.Tensor, n_q: torch.Tensor, R: int,
                 chunk_first: torch.Tensor) -> Dict[Tuple[int, int], CallPlan]:
    """Full calls per (source, chunk) from pairs sorted by (source, chunk, row, position).

    Consecutive pieces of one document that see the same keys of a chunk form one
    segment (their visible sets are nested, so equal counts mean equal keys).
    ``chunk_first``: per pair, the slot its chunk's buffer starts at.
    """
    if src.numel() == 0:
        return {}
    new = torch.ones_like(src, dtype=torch.bool)
    new[1:] = ((src[1:] != src[:-1]) | (chunk[1:] != chunk[:-1]) | (row[1:] != row[:-1])
               | (doc[1:] != doc[:-1]) | (n_k[1:] != n_k[:-1]) | (slot[1:] != slot[:-1]))
    head = torch.nonzero(new).flatten()
    group = torch.cumsum(new.long(), 0) - 1
    seg_q = torch.zeros(head.numel(), dtype=torch.long).index_add_(0, group, n_q)
    seg_k, seg_slot, seg_row = n_k[head], slot[head] - chunk_first[head], row[head]
    key = src[head] * (int(chunk.max()) + 1) + chunk[head]
    q_index = ranges(q_first, n_q) * R + torch.repeat_interleave(row, n_q)
    k_index = ranges(seg_slot, seg_k) * R + torch.repeat_interleave(seg_row, seg_k)
    # Split per (source, chunk): pairs, segments and their rows are all in that order.
    keys, seg_per_call = torch.unique_consecutive(key, return_counts=True)
    call_of_seg = torch.repeat_interleave(torch.arange(keys.numel()), seg_per_call)
    q_split = torch.zeros(keys.numel(), dtype=torch.long).index_add_(0, call_of_seg, seg_q)
    k_split = torch.zeros_like(q_split).index_add_(0, call_of_seg, seg_k)
    heads = head[torch.cumsum(seg_per_call, 0) - seg_per_call]
    calls = {}
    for s, c, qi, ki, ql, kl in zip(src[heads].tolist(), chunk[heads].tolist(), q_index.split(q_split.tolist()),
                                    k_index.split(k_split.tolist()), seg_q.split(seg_per_call.tolist()),
                                    seg_k.split(seg_per_call.tolist())):
        calls[(s, c)] = CallPlan(False, qi, ki, tuple(ql.tolist()), tuple(kl.tolist()))
    return calls


def _windowed_calls(kind: str, runs: RankRuns, rank: int, counts, intervals, window: int, c: int, R: int,
                    row, ds, pa, pb, q_first) -> Dict[Tuple[int, int], List[CallPlan]]:
    """Per (source, chunk): the full and banded calls of a sliding window.

    Piece [pa, pb) of a document starting at ds needs keys [max(ds, pa - window), pa)
    from other pieces; each run of a source's positions in that range, cut at chunk
    boundaries, is one segment [ka, kb) for the piece's queries that see any of it,
    [pa, min(pb, kb + window)). Where the last of them still sees ka, every query sees
    every key (full); else the band's lower edge is the window in bottom-right terms,
    window - (q_end - kb), and segments sharing that value share a call.
    """
    L = runs.local_len
    lo = torch.maximum(ds, pa - window)
    by_start, by_len, _ = runs.by_position()
    piece, k_start, n = map_ranges(by_start, by_len, by_start, lo, pa - lo)  # key position runs, split at runs
    if piece.numel() == 0:
        return {}
    owner_run = torch.searchsorted(by_start, k_start, right=True) - 1
    src = runs.rank[runs.by_position()[2][owner_run]]
    flat = runs.flat_before(k_start)  # [cp, m]
    cols = torch.arange(k_start.numel())
    if kind == "ring":
        slot = flat[src, cols] - src * L
    else:
        slot = _needed_offsets(runs, rank, *intervals, k_start)[src, cols]
        own = src == rank
        slot = torch.where(own, flat[src, cols] - src * L, slot)
    remote = src != rank
    first = torch.where(remote, slot // c, torch.zeros_like(slot))
    last = torch.where(remote, (slot + n - 1) // c, torch.zeros_like(slot))
    which = torch.repeat_interleave(torch.arange(src.numel()), last - first + 1)
    chunk = ranges(first, last - first + 1)
    s_lo = torch.where(remote[which], torch.maximum(slot[which], chunk * c), slot[which])
    s_hi = torch.where(remote[which], torch.minimum((slot + n)[which], (chunk + 1) * c), (slot + n)[which])
    ka = k_start[which] + s_lo - slot[which]
    kb = ka + (s_hi - s_lo)
    p = piece[which]
    q_end = torch.minimum(pb[p], kb + window)
    band = ka < q_end - 1 - window
    win = torch.where(band, window - (q_end - kb), torch.full_like(kb, -1))  # -1: full
    s_src = src[which]
    chunk_first = torch.where(s_src == rank, torch.zeros_like(chunk), chunk * c)
    order = torch.argsort(((s_src * (int(chunk.max()) + 1) + chunk) * (window + 2) + win + 1) * (p.numel() + 1)
                          + torch.arange(p.numel()))
    out: Dict[Tuple[int, int], List[CallPlan]] = {}
    cols = [t[order] for t in (s_src, chunk, win, p, s_lo - chunk_first, kb - ka, q_end - pa[p])]
    keys = list(zip(cols[0].tolist(), cols[1].tolist(), cols[2].tolist()))
    start = 0
    while start < len(keys):
        stop = start
        while stop < len(keys) and keys[stop] == keys[start]:
            stop += 1
        s, ch, w = keys[start]
        group = [t[start:stop] for t in cols[3:]]
        # (09308a2) the n-th segment of a piece in a (source, chunk, window) goes to the n-th call:
        # one call holds a query row at most once.
        seen = {}
        occurrence = []
        for x in group[0].tolist():
            occurrence.append(seen.get(x, 0))
            seen[x] = occurrence[-1] + 1
        occurrence = torch.tensor(occurrence)
        for n in range(int(occurrence.max()) + 1):
            pp, k_first, nk, nq = (t[occurrence == n] for t in group)
            q_index = ranges(q_first[pp], nq) * R + torch.repeat_interleave(row[pp], nq)
            k_index = ranges(k_first, nk) * R + torch.repeat_interleave(row[pp], nk)
            out.setdefault((s, ch), []).append(CallPlan(False, q_index, k_index, tuple(nq.tolist()),
                                                        tuple(nk.tolist()), None if w < 0 else w))
        start = stop
    return out


def reference_build_stream_plan(kind: str, runs: RankRuns, rows: Sequence[DocRuns], rank: int,
                      counts: torch.Tensor, intervals: Tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                      window: Optional[int] = None) -> StreamPlan:
    """This rank's steps for chunk ``kind``; ``counts``/``intervals`` are the plan's global tables.

    ``window``: a sliding window (query p sees keys from p - window), see ``_windowed_calls``.
    """
    if kind not in CHUNK_KINDS:
        raise KeyError(f"unknown chunk kind {kind!r}; known: {CHUNK_KINDS}")
    cp, L, R = runs.cp, runs.local_len, len(rows)
    c = chunk_rows_for(L)
    row, doc, ds, pa, pb, q_first = _pieces(runs, rows, rank)
    n_q = pb - pa
    calls: Dict[Tuple[int, int], Tuple[CallPlan, ...]] = {}
    causal: Optional[CallPlan] = None
    if row.numel() and window is not None:
        calls = {key: tuple(v) for key, v in _windowed_calls(kind, runs, rank, counts, intervals, window, c, R,
                                                              row, ds, pa, pb, q_first).items()}
        diag = ranges(q_first, n_q) * R + torch.repeat_interleave(row, n_q)
        lens = tuple(n_q.tolist())
        causal = CallPlan(True, diag, diag, lens, lens, window if int(n_q.max()) > window + 1 else None)
    elif row.numel():
        before_ds = runs.flat_before(ds)  # [cp, n]
        n_k = runs.flat_before(pa) - before_ds  # [cp, n]: each source's positions in [ds, pa)
        if kind == "ring":
            slot = before_ds - (torch.arange(cp) * L).unsqueeze(1)
        else:
            slot = _needed_offsets(runs, rank, *intervals, ds)
            slot[rank] = before_ds[rank] - rank * L  # own chunk: local order
        src, piece = torch.nonzero(n_k > 0, as_tuple=True)  # source-major, pieces ascending
        src, chunk, piece, lo, n = _split_at_chunks(src, slot[src, piece], n_k[src, piece], piece, rank, c)
        calls = {key: (call,) for key, call in _group_calls(
            src, chunk, row[piece], doc[piece], n, lo, q_first[piece], n_q[piece], R,
            torch.where(src == rank, torch.zeros_like(chunk), chunk * c)).items()}
        diag = ranges(q_first, n_q) * R + torch.repeat_interleave(row, n_q)
        lens = tuple(n_q.tolist())
        causal = CallPlan(True, diag, diag, lens, lens)
        # Pieces of one document (and row) that touch in local storage attend their own keys as one
        # causal block; its full segment is the own keys before the run's first piece.
        runs_of = []  # [first, last] piece of each run
        for p in range(n_q.numel()):
            last = runs_of[-1][1] if runs_of else None
            if last is not None and row[p] == row[last] and doc[p] == doc[last] \
                    and q_first[p] == q_first[last] + n_q[last]:
                runs_of[-1][1] = p
            else:
                runs_of.append([p, p])
        if len(runs_of) < n_q.numel():
            first = torch.tensor([a for a, _ in runs_of])
            total = torch.tensor([int(n_q[a:b + 1].sum()) for a, b in runs_of])
            seen = n_k[rank, first]
            h, nk, nq = first[seen > 0], seen[seen > 0], total[seen > 0]
            own_full = _group_calls(torch.full_like(h, rank), torch.zeros_like(h), row[h], doc[h], nk,
                                    slot[rank, h], q_first[h], nq, R, torch.zeros_like(h))
            calls[(rank, 0)] = (own_full[(rank, 0)],) if own_full else ()
            lens = tuple(total.tolist())
            causal = CallPlan(True, diag, diag, lens, lens)
    own = calls.get((rank, 0), ()) + ((causal,) if causal is not None else ())
    steps: List[Step] = [Step(0, 0, rank, 0, L, own)]
    reach = RingReach.of(runs, intervals, c) if kind == "ring" else None
    for i, j in remote_steps(kind, counts, L, c, reach):
        src = (rank - i) % cp
        steps.append(remote_step(i, j, src, int(counts[src, rank]), c, R, calls.get((src, j), ()), reach))
    return StreamPlan(kind, rank, cp, R, L, c, tuple(steps), reach)
