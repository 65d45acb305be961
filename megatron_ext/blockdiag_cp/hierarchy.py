"""Two-level K/V routes: what a node needs from another node crosses InfiniBand once.

A CP group of ``cp`` ranks on nodes of ``g`` ranks (rank r on node r // g). The
needed-only exchange (``plan.ExchangeTables``) has every rank fetch its own rows,
so when the 8 ranks of a node all hold pieces of a long document, its earlier
keys cross IB 8 times. The hierarchical exchange (the idea of TransformerEngine's
``a2a+p2p`` CP) routes them in two stages:

1. one exchange over the group: a rank sends its rows to the ranks of its own
   node that need them (direct, NVLink), and the rows a *remote* node needs to
   that node's fetchers (IB). Node N's remote rows R(N) (the positions its ranks
   need and no rank of N owns, ascending) are cut into ``g`` equal windows; the
   j-th rank of N fetches window j, from whichever ranks own it. Every row of
   R(N) crosses IB once, and N's NICs share the load equally;
2. inside each node: a fetcher forwards the rows of its window to the other
   ranks of its node that need them (NVLink).

Every table is computed on every rank from the layout's runs and the needed
intervals (``intervals.work_and_intervals``), like ``plan.ExchangeTables``: the
same decisions everywhere, no communication. ``NodeRoutes`` holds the global
pieces (what the cost model prices, ``layout_traffic``); ``HierarchicalRoute`` is
one rank's indices for the transport (``hierarchical_exchange``), whose output
equals the needed-only buffer: local rows, then the received rows grouped
by source rank in rank order, ascending position within a source.
"""

from dataclasses import dataclass, fields
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from .cost import CostModel, Traffic
from .intervals import (DocRuns, RankRuns, clip, document_runs, expand, flat_ranges, map_ranges, merge_intervals,
                        overlap_counts, overlap_pieces, owned_ranges, ranges, search, work_and_intervals)


@dataclass(frozen=True)
class NodeRoutes:
    """The two-stage routes of a whole group (global: identical on every rank).

    Fetch pieces (stage 1, IB): ``owner`` sends positions [start, end) to
    ``fetcher`` (a rank of another node); node-major, ascending within a node.
    Forward pieces (stage 2, NVLink): ``fetcher`` forwards [start, end) (owned by
    ``owner``) to ``dst`` of its node; ascending position per (fetcher, dst).
    ``direct[src, dst]``: positions sent straight to a rank of the same node.
    """

    cp: int
    ranks_per_node: int
    padded_len: int
    direct: torch.Tensor  # [cp, cp] int64
    fetch_owner: torch.Tensor
    fetch_rank: torch.Tensor
    fetch_start: torch.Tensor
    fetch_end: torch.Tensor
    forward_fetcher: torch.Tensor
    forward_dst: torch.Tensor
    forward_owner: torch.Tensor
    forward_start: torch.Tensor
    forward_end: torch.Tensor

    def fetch_counts(self) -> torch.Tensor:
        """[cp, cp] positions owner -> fetcher over IB."""
        return _matrix(self.cp, self.fetch_owner, self.fetch_rank, self.fetch_end - self.fetch_start)

    def forward_counts(self) -> torch.Tensor:
        """[cp, cp] positions fetcher -> dst over NVLink."""
        return _matrix(self.cp, self.forward_fetcher, self.forward_dst, self.forward_end - self.forward_start)

    def traffic(self) -> Traffic:
        fetch, fwd = self.fetch_counts(), self.forward_counts()
        nz = lambda m: (m > 0).long()  # noqa: E731
        intra_msgs = torch.maximum(nz(self.direct).sum(0) + nz(fwd).sum(0), nz(self.direct).sum(1) + nz(fwd).sum(1))
        return Traffic(self.direct.sum(0) + fwd.sum(0), self.direct.sum(1) + fwd.sum(1),
                       fetch.sum(0), fetch.sum(1), intra_msgs,
                       torch.maximum(nz(fetch).sum(0), nz(fetch).sum(1)))


def _matrix(cp: int, src: torch.Tensor, dst: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    return torch.zeros(cp * cp, dtype=torch.long).index_add_(0, src * cp + dst, n).view(cp, cp)


def node_routes(runs: RankRuns, dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ranks_per_node: int,
                counts: Optional[torch.Tensor] = None) -> NodeRoutes:
    """The routes for needed intervals (dst, a, b) (disjoint per dst, sorted by (dst, a)).

    ``counts``: ``overlap_counts(runs, dst, a, b)`` when already at hand.
    """
    cp, P, g = runs.cp, runs.padded_len, int(ranks_per_node)
    if g < 1:
        raise ValueError(f"node_routes: ranks_per_node must be >= 1, got {ranks_per_node!r}")
    rank = torch.arange(cp)
    same = (rank.view(-1, 1) // g) == (rank.view(1, -1) // g)
    counts = overlap_counts(runs, dst, a, b) if counts is None else counts
    direct = counts * same
    empty = torch.empty(0, dtype=torch.long)

    # R(N): node N's needed intervals (union over its ranks) cut at the owners' runs, remote owners only.
    node, na, nb = merge_intervals(dst // g, a, b, P)
    by_start, by_len, by_run = runs.by_position()
    which, part, pa, pb = clip(na, nb, by_start, by_start + by_len) if na.numel() else (empty,) * 4
    owner = runs.rank[by_run[part]]
    N = node[which]
    remote = owner // g != N
    N, owner, pa, pb = N[remote], owner[remote], pa[remote], pb[remote]
    n_nodes = -(-cp // g)
    if N.numel() == 0:
        return NodeRoutes(cp, g, P, direct, *(empty,) * 4, *(empty,) * 5)

    # Windows: node N's remote rows, in position order, cut into g equal shares (fetcher j takes share j).
    length = pb - pa
    total = torch.zeros(n_nodes, dtype=torch.long).index_add_(0, N, length)
    node_base = torch.cumsum(total, 0) - total
    off = torch.cumsum(length, 0) - length - node_base[N]  # offset of each piece inside its node's R(N)
    j = torch.arange(g + 1)
    bounds = (total.view(-1, 1) * j.view(1, -1)) // g  # [n_nodes, g + 1]
    stride = P + 1
    inner = (torch.arange(n_nodes).view(-1, 1) * stride + bounds[:, 1:g]).reshape(-1)  # interior bounds
    first = search(inner, N * stride + off, right=True) - N * (g - 1)
    last = search(inner, N * stride + off + length - 1, right=True) - N * (g - 1)
    piece, window = expand(first, last - first + 1)
    lo = torch.maximum(off[piece], bounds[N[piece], window])
    hi = torch.minimum(off[piece] + length[piece], bounds[N[piece], window + 1])
    keep = hi > lo
    piece, window, lo, hi = piece[keep], window[keep], lo[keep], hi[keep]
    f_owner = owner[piece]
    f_rank = N[piece] * g + window
    f_start = pa[piece] + lo - off[piece]
    f_end = f_start + (hi - lo)
    keep = f_rank < cp  # a last, partial node has fewer than g ranks: its empty windows past cp hold nothing
    f_owner, f_rank, f_start, f_end = f_owner[keep], f_rank[keep], f_start[keep], f_end[keep]

    # Stage 2: every rank's intervals against its node's fetch pieces (disjoint, ascending per node).
    f_node = f_rank // g
    q, t, x, y = overlap_pieces(f_node * stride + f_start, f_node * stride + f_end,
                                (dst // g) * stride + a, (dst // g) * stride + b)
    fwd_fetcher, fwd_dst = f_rank[t], dst[q]
    keep = fwd_fetcher != fwd_dst
    base = (fwd_dst // g) * stride
    return NodeRoutes(cp, g, P, direct, f_owner, f_rank, f_start, f_end,
                      fwd_fetcher[keep], fwd_dst[keep], f_owner[t][keep], (x - base)[keep], (y - base)[keep])


def layout_traffic(runs: RankRuns, rows: Sequence[DocRuns], cost_model: CostModel, exchange: str = "needed",
                   intervals=None, counts: Optional[torch.Tensor] = None) -> Traffic:
    """What each rank receives and sends, by link, for this layout under ``cost_model``'s topology.

    ``exchange``: "needed" (needed-only: a2a / halo, or the hierarchical routes of
    a two-level hierarchical model) or "allgather" (every rank's rows to every
    rank, a ring: across nodes the slowest hop, IB, sets every step).
    ``intervals`` (dst, a, b) and ``counts`` when already at hand.
    """
    cp, L = runs.cp, runs.local_len
    two_level = cost_model.spans_nodes(cp)
    if exchange == "allgather":
        moved = torch.full((cp,), (cp - 1) * L, dtype=torch.long)
        zero, msgs = torch.zeros(cp, dtype=torch.long), torch.full((cp,), 1 if cp > 1 else 0)
        if two_level:
            return Traffic(zero, zero, moved, moved, zero, msgs)
        return Traffic(moved, moved, zero, zero, msgs, zero)
    if exchange != "needed":
        raise ValueError(f"layout_traffic: exchange must be 'needed' or 'allgather', got {exchange!r}")
    if intervals is None:
        _, dst, a, b = work_and_intervals(runs, rows)
    else:
        dst, a, b = intervals
    if counts is None:
        counts = overlap_counts(runs, dst, a, b)
    return needed_traffic(runs, (dst, a, b), counts, cost_model)[0]


def needed_traffic(runs: RankRuns, intervals, counts: torch.Tensor, cost_model: CostModel
                   ) -> Tuple[Traffic, Optional[NodeRoutes]]:
    """The needed-only exchange's traffic under ``cost_model``, and the node routes it priced (None
    unless the model is two-level and hierarchical), for a caller that plans those routes next."""
    g, two_level = cost_model.ranks_per_node, cost_model.spans_nodes(runs.cp)
    if two_level and cost_model.hierarchical:
        routes = node_routes(runs, *intervals, g, counts)
        return routes.traffic(), routes
    return Traffic.from_counts(counts, g if two_level else 0), None


# ---------------------------------------------------------------------------
# One rank's route: the transport's indices
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class HierarchicalRoute:
    """This rank's indices for ``hierarchical_exchange.hierarchical_needed_kv``.

    Stage 1 (one exchange over the CP group): ``send1_index`` local rows grouped by
    peer in rank order (``send1_counts``), received into a buffer grouped by peer
    (``recv1_counts``). Stage 2 (inside the node): ``send2_index`` rows of the
    stage-1 buffer forwarded per peer (``send2_counts``), ``recv2_counts`` received.
    The output buffer [local_len + needed] takes the stage-1 rows at ``slot1``
    (-1: fetched for the node only, not needed here) and the stage-2 rows at ``slot2``;
    ``kept1`` are the stage-1 rows this rank needs (``slot1 >= 0``) and ``kept1_slot``
    their slots, so a layer call copies them with index tensors instead of a boolean
    mask (a host sync on a device).
    ``inter1_send`` / ``inter1_recv``: stage-1 rows that cross a node boundary.
    """

    rank: int
    cp: int
    ranks_per_node: int
    local_len: int
    out_rows: int  # local_len + positions this rank needs and does not own
    send1_index: torch.Tensor
    send1_counts: List[int]
    recv1_counts: List[int]
    send2_index: torch.Tensor
    send2_counts: List[int]
    recv2_counts: List[int]
    slot1: torch.Tensor
    slot2: torch.Tensor
    kept1: torch.Tensor  # [n] rows of the stage-1 buffer with slot1 >= 0, ascending
    kept1_slot: torch.Tensor  # [n] slot1 of those rows
    stage1_moves: bool  # anything moves in stage 1 on any rank (global: the same on every rank)
    stage2_moves: bool
    inter1_send: int
    inter1_recv: int

    def to(self, device) -> "HierarchicalRoute":
        """The same route with its index tensors on ``device`` (once per step, not per layer)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("send1_index", "send2_index", "slot1", "slot2", "kept1", "kept1_slot"):
            values[name] = values[name].to(device)
        return HierarchicalRoute(**values)


def build_hierarchical_route(layout, doc_ids: torch.Tensor, rank: int, ranks_per_node: int,
                             routes: Optional[NodeRoutes] = None, window: Optional[int] = None,
                             intervals=None, counts: Optional[torch.Tensor] = None) -> HierarchicalRoute:
    """This rank's route for ``layout`` (``layouts.Layout``) and padded doc ids [R, P] or [P].

    Computed identically on every rank from global tables; ``routes`` when already at hand.
    ``window``: the rows a sliding window needs (``plan.build_plan``'s ``window``).
    ``intervals`` (dst, a, b) and ``counts``: the plan's needed intervals for that window and
    their ``overlap_counts``, when the caller has them (``plan.plan_with_tables``).
    """
    runs = layout.runs
    if intervals is None:
        ids = doc_ids.reshape(-1, doc_ids.shape[-1])
        rows = [document_runs(ids[r]) for r in range(ids.shape[0])]
        _, dst, a, b = work_and_intervals(runs, rows, window)
    else:
        dst, a, b = intervals
    if routes is None:
        routes = node_routes(runs, dst, a, b, ranks_per_node, counts)
    return rank_route(routes, runs, (dst, a, b), rank)


def _by_peer(mask: torch.Tensor, peer: torch.Tensor, cp: int, *columns: torch.Tensor):
    """peer -> the ``columns`` of the rows where ``mask`` holds and ``peer`` is that peer, in row order."""
    rows = torch.nonzero(mask).flatten()
    order = torch.sort(peer[rows], stable=True)
    rows = rows[order.indices]
    bounds = torch.searchsorted(order.values, torch.arange(cp + 1)).tolist()
    picked = [c[rows] for c in columns]
    return lambda p: tuple(c[bounds[p]:bounds[p + 1]] for c in picked)


def rank_route(routes: NodeRoutes, runs: RankRuns, intervals, rank: int) -> HierarchicalRoute:
    """One rank's view of ``routes`` (see ``HierarchicalRoute``)."""
    dst, a, b = intervals
    cp, g, P, L = routes.cp, routes.ranks_per_node, routes.padded_len, runs.local_len
    node = rank // g
    empty = torch.empty(0, dtype=torch.long)
    stride = P + 1

    def local_rows(starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """Local indices of this rank's positions [start, end) (each inside one of its runs)."""
        if starts.numel() == 0:
            return empty
        return ranges(runs.flat_before(starts, rank) - rank * L, ends - starts)

    def node_positions():
        """peer -> (start, end) of the ranges of this rank's positions inside that node peer's
        intervals, ascending: every node peer's at once (each interval maps on its own, and the
        intervals are sorted by dst, so a peer's ranges are a slice of them)."""
        mine = (torch.div(dst, g, rounding_mode="floor") == node) & (dst != rank)
        lo, hi = flat_ranges(runs, a[mine], b[mine], rank)
        keep = hi > lo
        lo, hi, peer_of = lo[keep], hi[keep], dst[mine][keep]
        # flat -> positions through this rank's runs: a flat range inside one run maps linearly
        s = runs.of_rank(rank)
        q, start, n = map_ranges(runs.flat[s], runs.length[s], runs.start[s], lo, hi - lo)
        end = start + n
        bounds = torch.searchsorted(peer_of[q], torch.arange(cp + 1)).tolist()
        return lambda p: (start[bounds[p]:bounds[p + 1]], end[bounds[p]:bounds[p + 1]])

    # What this rank needs: (source, position) ranges in the output buffer's order (by source, then
    # position; every source at once, as the plan's receive tables), the output slot of a range's
    # first row at L + its offset.
    mine = dst == rank
    need_src = need_start = need_end = empty
    if bool(mine.any()):
        _, _, need_src, need_start, length = owned_ranges(runs, a[mine], b[mine], rank)
        need_end = need_start + length
    need_off = torch.cumsum(need_end - need_start, 0) - (need_end - need_start)
    out_rows = L + int((need_end - need_start).sum())

    # Stage 1: per peer in rank order, what this rank sends and receives (received rows as ranges of
    # (peer, position), ascending: by peer, then position).
    send_starts, send_ends, send_counts, recv_counts = [], [], [], []
    r1_peer, r1_start, r1_end = [], [], []
    inter_send = inter_recv = 0
    # This rank's fetch pieces as owner and as fetcher, grouped by the other end once (stable: each
    # peer's pieces keep their order), not masked per peer (THD's routes hold millions of pieces).
    as_owner = _by_peer(routes.fetch_owner == rank, routes.fetch_rank, cp, routes.fetch_start, routes.fetch_end)
    as_fetcher = _by_peer(routes.fetch_rank == rank, routes.fetch_owner, cp, routes.fetch_start, routes.fetch_end)
    to_node_peer = node_positions()
    for peer in range(cp):
        if peer == rank:
            send_counts.append(0)
            recv_counts.append(0)
            continue
        if peer // g == node:  # direct, inside the node
            s_start, s_end = to_node_peer(peer)
            from_peer = need_src == peer
            r_start, r_end = need_start[from_peer], need_end[from_peer]
        else:  # fetch pieces: this rank as owner (to fetcher peer) and as fetcher (from owner peer)
            s_start, s_end = as_owner(peer)
            r_start, r_end = as_fetcher(peer)
        # Every peer's send rows are made at once after the loop (local_rows is elementwise then a
        # concatenation of ranges, so one call on all peers' ranges is the peers' calls end to end).
        send_starts.append(s_start)
        send_ends.append(s_end)
        n_send = int((s_end - s_start).clamp(min=0).sum()) if s_start.numel() else 0
        send_counts.append(n_send)
        n_recv = int((r_end - r_start).sum())
        r1_peer.append(torch.full_like(r_start, peer))
        r1_start.append(r_start)
        r1_end.append(r_end)
        recv_counts.append(n_recv)
        if peer // g != node:
            inter_send += n_send
            inter_recv += n_recv
    send1_index = local_rows(torch.cat(send_starts), torch.cat(send_ends)) if send_starts else empty
    recv1 = tuple(torch.cat(x) if x else empty for x in (r1_peer, r1_start, r1_end))


    def slots(owner: torch.Tensor, start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
        """Output slot of each row of the ranges [start, end) of ``owner`` (in range order), -1
        where this rank does not need it: the ranges cut at the needed ranges (interval arithmetic)."""
        n = end - start
        total = int(n.sum()) if n.numel() else 0
        out = np.full(total, -1, dtype=np.int64)  # numpy: its scatter of ~10^6 rows is ~3x faster than torch's
        if total == 0 or need_start.numel() == 0:
            return torch.from_numpy(out)
        key_start, key_end = owner * stride + start, owner * stride + end
        q, t, lo, hi = overlap_pieces(need_src * stride + need_start, need_src * stride + need_end,
                                      key_start, key_end)
        row_off = torch.cumsum(n, 0) - n
        at = ranges(row_off[q] + lo - key_start[q], hi - lo)
        out[at.numpy()] = ranges(L + need_off[t] + lo - (need_src[t] * stride + need_start[t]), hi - lo).numpy()
        return torch.from_numpy(out)

    # Stage 2: forward pieces from this rank (as fetcher) and to it, per node peer in rank order.
    r1_key = recv1[0] * stride + recv1[1]  # stage-1 ranges' first keys, ascending
    r1_off = torch.cumsum(recv1[2] - recv1[1], 0) - (recv1[2] - recv1[1])  # their rows in the stage-1 buffer
    send2_parts, send2_counts, recv2_counts = [], [], []
    r2_owner, r2_start, r2_end = [], [], []
    # This rank's forward pieces as fetcher (by destination) and as destination (by fetcher), grouped
    # once as in stage 1, not masked per node peer.
    forwards = (routes.forward_owner, routes.forward_start, routes.forward_end)
    as_forwarder = _by_peer(routes.forward_fetcher == rank, routes.forward_dst, cp, *forwards)
    as_forward_dst = _by_peer(routes.forward_dst == rank, routes.forward_fetcher, cp, *forwards)
    for peer in range(cp):
        if peer == rank or peer // g != node:
            send2_counts.append(0)
            recv2_counts.append(0)
            continue
        o_owner, o_start, o_end = as_forwarder(peer)
        # Each forward piece lies inside one fetch piece: contiguous rows of the stage-1 buffer.
        key = o_owner * stride + o_start
        j = search(r1_key, key, right=True) - 1
        rows = ranges(r1_off[j] + key - r1_key[j], o_end - o_start) if j.numel() else empty
        send2_parts.append(rows)
        send2_counts.append(rows.numel())
        i_owner, i_start, i_end = as_forward_dst(peer)
        r2_owner.append(i_owner)
        r2_start.append(i_start)
        r2_end.append(i_end)
        recv2_counts.append(int((r2_end[-1] - r2_start[-1]).sum()))
    send2_index = torch.cat(send2_parts) if send2_parts else empty
    recv2 = tuple(torch.cat(x) if x else empty for x in (r2_owner, r2_start, r2_end))

    slot1 = slots(*recv1)
    slot2 = slots(*recv2)
    # The checks in numpy, a byte per row: torch's indexed increments of ~10^6 rows cost ~3x more
    # (~15 ms of a 1M / cp 64 single document's route).
    s1, s2 = slot1.numpy(), slot2.numpy()
    assert bool((s2 >= 0).all()), "route bug: a forwarded row is not needed by its destination"
    kept1 = (s1 >= 0).nonzero()[0]
    delivered = np.zeros(out_rows, dtype=np.int8)
    delivered[s1[kept1]] += 1
    delivered[s2] += 1
    assert bool((delivered[L:] == 1).all()), "route bug: a needed row is not delivered exactly once"
    fetch_moves = routes.fetch_owner.numel() > 0
    return HierarchicalRoute(
        rank=rank, cp=cp, ranks_per_node=g, local_len=L, out_rows=out_rows,
        send1_index=send1_index, send1_counts=send_counts, recv1_counts=recv_counts,
        send2_index=send2_index, send2_counts=send2_counts, recv2_counts=recv2_counts,
        slot1=slot1, slot2=slot2, kept1=torch.from_numpy(kept1), kept1_slot=torch.from_numpy(s1[kept1]),
        stage1_moves=bool(fetch_moves or bool((routes.direct > 0).any())),
        stage2_moves=routes.forward_fetcher.numel() > 0, inter1_send=inter_send, inter1_recv=inter_recv)


__all__ = ["NodeRoutes", "HierarchicalRoute", "node_routes", "layout_traffic", "build_hierarchical_route",
           "rank_route"]
