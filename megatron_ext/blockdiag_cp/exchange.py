"""K/V transports for the streamed op: one round at a time over p2p, in flight while compute runs.

A step moves one chunk of K/V to every rank at once (``chunks``): at step (i, j),
rank r receives piece j of the K/V of source (r - i) mod cp. Two transports deliver it:

    ring (allgather)     r sends r + 1 the piece it received at step (i - 1, j) (its own
                         piece j at i = 1) and receives from r - 1: every rank's local K/V
                         travels around the ring, neighbour links only (TE's p2p CP), each
                         piece only as far as a rank attends it and only its rows from the
                         first one attended to the last; a piece whose readers lie upstream
                         (zigzag's second) goes the other way, r to r - 1 (``RingReach``)

        step (1, j):  0 -> 1 -> 2 -> 3 -> 0      piece j of r - 1
        step (2, j):  the same links, forwarding  piece j of r - 2 ...

    needed (a2a, halo)   r sends r + i piece j of the rows of its own K/V that r + i needs and
                         receives from r - i piece j of the rows it needs: exactly the
                         needed-only lower bound, a step with nothing either way posts nothing;
                         in the band mode (``WholeNeededTransport``), each pair's rows are cut
                         into a few pieces, piece g of every pair is posted together for band
                         step g (one batch where the group is small, else pair by pair) and
                         placed in the bands' order (``gathered``)

    hierarchical         the needed rows, moved once per step through two-level routes
                         (``hierarchy``): what a node needs from another node crosses the
                         inter-node link once, fetched in equal shares by the node's ranks
                         and forwarded inside the node; the inter-node stage is in flight
                         while the local keys are attended, then the steps read slices of
                         the delivered buffer (memory O(needed), not O(chunk))

K and V travel fused in one buffer per step, [n, b, Hkv * (Dk + Dv)], built per piece (per
group for a band step in one batch). Where a piece is a run of the source's rows (every ring
piece; a2a / halo's where the source sends a run, which both ends read off the step's global
tables: ``plan.PairRuns``) and K and V are as wide, it travels planar instead: its K rows and
its V rows as they lie, two messages and no copy, landing as one buffer [2, n, b, Hkv * D]
(K, then V); its gradient goes home the same way.

Backward sends each chunk's K/V gradient straight home (to r - i, from r + i;
hierarchical: back through the routes at the end); the ring sends it only for the pieces
r needs rows of (``RingGradients``, from the plan's needed exchange: the other pieces'
gradients are zero, and their home posts no receive for them), and with ``kv_backward="refetch"``
moves the chunks again the same way instead of keeping them. Every transfer is counted from the tensors actually moved, and
the time a rank spends waiting for a transfer (what compute did not hide) is
recorded as exposed communication (``exposed_wait``): on the host for gloo, whose
waits block it; with CUDA events around the wait on a device, where a wait only
makes the stream wait (the host would read about 0 whatever the overlap), read
back by ``resolve_waits`` when the figures are wanted, never during a step.
"""

import contextlib
import os
import time
from collections import deque
from dataclasses import dataclass
from itertools import accumulate
from typing import Dict, FrozenSet, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from .chunks import RingReach
from .hierarchical_exchange import RouteForward, returned_rows
from .merge import gather, rows_of, set_rows
from .merge_kernel import gather_kv_rows_, gather_kv_rows_eager

# Opt-in: run the K/V transfers on CPU copies of device tensors. For gloo groups whose ranks
# share one GPU (NCCL refuses two ranks on one device; gloo's send/recv hands the raw device
# pointer to its TCP transport). Costs a device->host and a host->device copy per transfer.
STAGE_COLLECTIVES_ENV = "MEGATRON_EXT_STAGE_COLLECTIVES_ON_CPU"


def stage_collectives_on_cpu() -> bool:
    return os.environ.get(STAGE_COLLECTIVES_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


EVENTS_SUFFIX = "_events"  # stats[key + EVENTS_SUFFIX]: CUDA event pairs of waits not read back yet


@contextlib.contextmanager
def exposed_wait(stats: Dict, key: str, device: torch.device):
    """Time the wait inside into ``stats[key]`` (seconds): host time, or on a CUDA device (transfers not
    staged through the CPU) a pair of CUDA events around it on the current stream, kept under
    ``key + EVENTS_SUFFIX`` until ``resolve_waits``: the stream's stall there is the exposed time."""
    if device.type == "cuda" and not stage_collectives_on_cpu():
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        stats.setdefault(key + EVENTS_SUFFIX, []).append((start, end))
        stats.setdefault(key, 0.0)
        return
    t0 = time.perf_counter()
    yield
    stats[key] = stats.get(key, 0.0) + time.perf_counter() - t0


def resolve_waits(stats: Dict) -> Dict:
    """Add the CUDA-event waits recorded so far into their keys (waits for the events: call it after a
    step, not inside one); returns ``stats``."""
    for pending in [name for name in stats if name.endswith(EVENTS_SUFFIX)]:
        pairs = stats.pop(pending)
        key = pending[:-len(EVENTS_SUFFIX)]
        for start, end in pairs:
            end.synchronize()
            stats[key] = stats.get(key, 0.0) + start.elapsed_time(end) / 1e3  # ms
    return stats


def _nbytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class Transfer:
    """Posted sends/receives of one round; ``wait`` returns the received tensor (None: nothing)."""

    def __init__(self, requests, received: Optional[torch.Tensor], device, stats: Dict, key: str):
        self._requests, self._received, self._device = requests, received, device
        self._stats, self._key = stats, key

    def wait(self) -> Optional[torch.Tensor]:
        """The received tensor (None when nothing was received), after every transfer finished."""
        with exposed_wait(self._stats, self._key, self._device):
            for req in self._requests:
                req.wait()
        self._requests = []
        received = self._received
        if received is not None and received.device != self._device:
            received = received.to(self._device)  # staged through the CPU
        return received


def post(sends, recv_from: Optional[int], recv_shape, like: torch.Tensor, group, stats: Dict,
         wait_key: str, byte_key: str, planar: bool = False) -> Transfer:
    """Post this rank's sends [(tensor, group rank)] and one receive of ``recv_shape`` ([n, b, F]); nothing to do
    posts nothing. ``planar``: it arrives as two messages into one [2, n, b, F / 2] buffer, [0] then [1].

    Every rank of a round calls ``post`` once, with matching sends and receives, so
    each pair's transfers pair up in order; empty transfers are never posted.
    """
    recv_shape = tuple(recv_shape)
    if planar:
        recv_shape = (2,) + recv_shape[:-1] + (recv_shape[-1] // 2,)
    received = None
    if recv_from is not None and recv_shape[1 if planar else 0] > 0:
        received = receive_buffer(recv_shape, like)
    receives = [(received, recv_from)] if received is None or not planar else [(half, recv_from) for half in received]
    return post_into(sends, receives, received, like, group, stats, wait_key, byte_key)


def receive_buffer(shape, like: torch.Tensor) -> torch.Tensor:
    """An empty buffer for ``post_into`` to receive into: on the CPU where transfers are staged there."""
    staged = like.device.type != "cpu" and stage_collectives_on_cpu()
    return torch.empty(tuple(shape), dtype=like.dtype, device="cpu" if staged else like.device)


def post_into(sends, receives, received: Optional[torch.Tensor], like: torch.Tensor, group, stats: Dict,
              wait_key: str, byte_key: str) -> Transfer:
    """Post this rank's sends [(tensor, group rank)] and receives [(rows of ``received``, group rank)] as one
    batch; ``wait`` returns ``received`` (a ``receive_buffer``) on ``like``'s device. Empty ones are not posted;
    nothing to do posts nothing. Every rank posts its side of each pair in the same order."""
    staged = like.device.type != "cpu" and stage_collectives_on_cpu()
    ranks = dist.get_process_group_ranks(group)
    ops = [dist.P2POp(dist.irecv, into, ranks[peer], group)
           for into, peer in receives if into is not None and into.shape[0]]
    sent = 0
    for tensor, peer in sends:
        if tensor is None or tensor.shape[0] == 0:
            continue
        tensor = tensor.contiguous()
        ops.append(dist.P2POp(dist.isend, tensor.cpu() if staged else tensor, ranks[peer], group))
        sent += _nbytes(tensor)
    stats[byte_key + "_sent"] = stats.get(byte_key + "_sent", 0) + sent
    stats[byte_key + "_received"] = stats.get(byte_key + "_received", 0) + _nbytes(received)
    requests = dist.batch_isend_irecv(ops) if ops else []
    return Transfer(requests, received, like.device, stats, wait_key)


def post_all_to_all(sent: torch.Tensor, send_counts: List[int], received: torch.Tensor, recv_counts: List[int],
                    like: torch.Tensor, group, stats: Dict, wait_key: str, byte_key: str) -> Transfer:
    """``sent``'s rows to every rank (``send_counts`` each, in rank order) and ``recv_counts`` from each
    into ``received`` (a ``receive_buffer``), as one ``all_to_all_single``: a collective, so every rank of
    the group posts it at the same point; ``wait`` returns ``received`` on ``like``'s device. One call
    where ``post_into`` would post a send and a receive per peer (their host work grows with the peers)."""
    staged = like.device.type != "cpu" and stage_collectives_on_cpu()
    sent = sent.contiguous()
    work = dist.all_to_all_single(received, sent.cpu() if staged else sent, recv_counts, send_counts,
                                  group=group, async_op=True)
    stats[byte_key + "_sent"] = stats.get(byte_key + "_sent", 0) + _nbytes(sent)
    stats[byte_key + "_received"] = stats.get(byte_key + "_received", 0) + _nbytes(received)
    return Transfer([work], received, like.device, stats, wait_key)


def fused_width(k: torch.Tensor, v: torch.Tensor) -> int:
    """F of a fused K/V buffer [n, b, F]: Hkv * (Dk + Dv)."""
    return k.shape[2] * k.shape[3] + v.shape[2] * v.shape[3]


def planar_rows(k: torch.Tensor, v: torch.Tensor, rows) -> Tuple[torch.Tensor, torch.Tensor]:
    """K and V of local ``rows`` as they travel planar, [n, b, Hkv * D] each: views of a run (a gather each
    for an index tensor)."""
    return tuple(gather(t, rows).reshape(-1, t.shape[1], t.shape[2] * t.shape[3]) for t in (k, v))


def fused_rows(k: torch.Tensor, v: torch.Tensor, rows) -> torch.Tensor:
    """[n, b, Hkv * (Dk + Dv)]: K and V of local ``rows`` (a slice or an index tensor) in one buffer."""
    if isinstance(rows, slice):  # views: one pass
        k, v = k[rows], v[rows]
        return torch.cat([k, v], dim=-1).view(k.shape[0], k.shape[1], -1)
    # scattered rows: each gathered straight into its half of the buffer (one pass, not a gather and a cat),
    # K and V in one op where their (batch, head) dims are one of strides (a view; else the op's eager body,
    # a gather each, on the [L, b, H, D] tensors as they are)
    n = rows.numel()
    fused = torch.empty((n,) + tuple(k.shape[1:-1]) + (k.shape[-1] + v.shape[-1],), dtype=k.dtype, device=k.device)
    if not n:  # a rank that sends no row (a route's stage 1 can): no op
        return fused.view(0, k.shape[1], fused_width(k, v))
    if _merges_heads(k) and _merges_heads(v):
        k3, v3 = (t.view(t.shape[0], -1, t.shape[-1]) for t in (k, v))  # [L, b * H, D]
        gather_kv_rows_(fused.view(n, -1, fused.shape[-1]), k3, v3, rows)
    else:
        gather_kv_rows_eager(fused, k, v, rows)
    return fused.view(n, k.shape[1], -1)


def _merges_heads(t: torch.Tensor) -> bool:
    """Whether [L, b, H, D]'s b and H are one dim of strides (``view(L, b * H, D)`` needs no copy)."""
    return t.shape[1] == 1 or t.shape[2] == 1 or t.stride(1) == t.shape[2] * t.stride(2)


class _DirectGradients:
    """Gradients straight home: step (i, j)'s chunk gradient to its source, ours from rank + i.

    A step sends a gradient exactly when its home expects one (``gradient_rows``): zeros where
    the chunk came but no call here attended it, nothing where the home expects nothing.
    """

    # Where a step's transfers go: a subclass may hand them over instead (testing.loopback).
    post = staticmethod(post)

    @staticmethod
    def gradient_buffer(step, chunk) -> None:
        """Each chunk's gradient is a buffer of its own, sent as it is made (see ``HierarchicalTransport``)."""
        return None

    @staticmethod
    def gradient_places(step) -> None:
        """Where each row of the chunk lands in ``gradient_buffer``'s buffer (None: in order)."""
        return None

    @staticmethod
    def gradients_planar(step) -> Tuple[bool, bool]:
        """Whether the gradient of the chunk of ``step`` goes home planar, and ours comes back planar (each
        as its K/V travelled: ``NeededTransport.sends_planar`` / ``receives_planar``)."""
        return False, False

    def send_gradient(self, step, grad_chunk, like: torch.Tensor):
        """``grad_chunk``: [n, b, F], or where the chunk came planar its (dK, dV) rows, [n, b, F / 2] each."""
        rows, incoming = self.sent_rows(step)
        outgoing = self.gradient_rows(step)
        planar_out, planar_in = self.gradients_planar(step)
        if not outgoing:  # every such chunk gradient is zero (the plan's needs): its home posts no receive
            grad_chunk = None
        elif grad_chunk is None:
            grad_chunk = like.new_zeros((outgoing,) + tuple(like.shape[1:]))
            if planar_out:
                grad_chunk = grad_chunk.view(outgoing, like.shape[1], 2, -1).unbind(2)
        return (return_gradient(grad_chunk, step[0], incoming, self.rank, self.cp, like, self.group, self.stats,
                                self.post, planar_out, planar_in), rows, step)

    @staticmethod
    def settle(handle, dkv) -> None:
        """Add what came back for our rows (they went to that rank at this step) into ``dkv``
        (``merge.KeyGradients``)."""
        transfer, rows, step = handle
        grad_back = transfer.wait()
        if grad_back is not None:
            dkv.add(rows, grad_back, step)

    def finish(self, dkv) -> None:
        pass


def piece_rows(count: int, chunk_rows: int, piece: int) -> int:
    """Rows of piece ``piece`` when ``count`` rows move ``chunk_rows`` at a time (rows [piece * chunk_rows,
    + that)): chunk_rows, fewer for the last piece, 0 past it."""
    return max(0, min(chunk_rows, count - piece * chunk_rows))


@dataclass(frozen=True)
class Pieces:
    """How a pair's needed rows (ascending positions) are cut into its messages: ``rows`` at a time (the
    streamed steps' chunks), or into ``parts`` parts of equal rows (the band mode's groups: piece g of
    every pair then covers about the same documents, a pair that sends less sending smaller pieces)."""

    rows: int = 0
    parts: int = 0

    def span(self, count: int, piece: int) -> Tuple[int, int]:
        """(first row, rows) of piece ``piece`` of ``count`` rows; 0 rows past the last."""
        c = self.rows or max(1, -(-count // self.parts))
        return piece * c, piece_rows(count, c, piece)

    def count(self, count: int) -> int:
        """How many pieces ``count`` rows make."""
        return min(count, self.parts) if self.parts else -(-count // self.rows)


class RingTransport(_DirectGradients):
    """allgather as a ring: step (i, j) forwards piece j of the chunk received the hop before to the
    next rank (rank + 1, or rank - 1 for a piece that goes the other way: ``RingReach``)."""

    kind = "ring"

    def __init__(self, k, v, rank: int, cp: int, chunk_rows: int, group, stats: Dict, prefix: str,
                 gradients: "RingGradients", planar: bool = False, reach: Optional[RingReach] = None):
        self.k, self.v, self.rank, self.cp = k, v, rank, cp
        self.group, self.stats, self.prefix = group, stats, prefix
        self.gradients = gradients
        # which way each piece goes, which of its rows and which hops are posted (None: every hop, downstream)
        self.reach = reach if reach is not None else RingReach.every_hop(cp, k.shape[0], chunk_rows)
        self._last = None  # the piece received last: forwarded by the step after it
        self._posted = deque()  # the steps posted and not yet received, in posting order
        self._last_step = None  # the step ``_last`` came at
        # every piece is a run of a whole shard: planar where K and V are as wide (see NeededTransport)
        self.planar = planar and k.shape[2] * k.shape[3] == v.shape[2] * v.shape[3]

    def rows(self, step) -> int:
        """Rows of the piece that comes at ``step`` (of source rank - i)."""
        return self.reach.size((self.rank - step[0]) % self.cp, step[1])

    def can_start(self, step) -> bool:
        """Whether ``step`` can be posted now: a piece of our own (hop 1) any time, a forwarded one once
        the step before it in the ring (one hop fewer, same piece) has landed and nothing landed since."""
        return self.reach.hop(step) == 1 or self._last_step == self.reach.step_before(step)

    def start(self, step) -> Transfer:
        j = step[1]
        if not self.can_start(step):
            raise RuntimeError(f"blockdiag-cp: ring step {step} posted before step "
                               f"{self.reach.step_before(step)} landed")
        self._posted.append(step)
        first = self.reach.hop(step) == 1
        n, dst, src = self.rows(step), self.reach.downstream(self.rank, j), self.reach.upstream(self.rank, j)
        own = self.reach.rows(self.rank, j)
        sending = self.reach.sends(self.rank, step)
        recv_from = src if self.reach.receives(self.rank, step) else None
        if sending and not first and self._last is None:
            raise RuntimeError(f"blockdiag-cp: ring step {step} forwards a piece that never came")
        if not sending:
            sends = []
        elif self.planar:
            sends = [(half, dst) for half in (planar_rows(self.k, self.v, own) if first else self._last)]
        else:
            sends = [(fused_rows(self.k, self.v, own) if first else self._last, dst)]
        shape = (n, self.k.shape[1], fused_width(self.k, self.v))  # [n, b, F]: post lands it planar or fused
        return self.post(sends, recv_from, shape, self.k[:0], self.group, self.stats, self.prefix + "wait_seconds",
                         self.prefix + "bytes", planar=self.planar)

    def gradients_planar(self, step) -> Tuple[bool, bool]:
        return self.planar, self.planar

    def received(self, chunk: torch.Tensor) -> None:
        self._last, self._last_step = chunk, self._posted.popleft()

    def sent_rows(self, step):
        """This rank's own piece that reached rank + i at ``step``: rows, and the rows of gradient
        coming back for it (0: rank + i needs none of them)."""
        j = step[1]
        return self.reach.rows(self.rank, j), self.reach.size(self.rank, j) if step in self.gradients.returned else 0

    def gradient_rows(self, step) -> int:
        """Rows of the gradient this rank sends home for the chunk of ``step`` (0: it needs none of it)."""
        return self.rows(step) if step in self.gradients.sent else 0


class NeededTransport(_DirectGradients):
    """a2a / halo: step (i, j) sends rank + i piece j of its needed rows, receives piece j from rank - i."""

    kind = "needed"

    def __init__(self, k, v, rank: int, cp: int, pieces: Pieces, group, stats: Dict, prefix: str,
                 send_index: List[Optional[torch.Tensor]], counts: torch.Tensor, fuse_sends: bool = False,
                 runs=None):
        self.k, self.v, self.rank, self.cp, self.pieces = k, v, rank, cp, pieces  # how a pair's rows are cut
        self.group, self.stats, self.prefix = group, stats, prefix
        self.send_index = send_index
        # The host table as Python ints: reading a tensor element per step costs a dispatch each
        # (and on a device it would be a sync, were the table ever moved there).
        self.sent_to, self.received_from = counts[rank].tolist(), counts[:, rank].tolist()
        # ``plan.PairRuns`` of the step: the pairs that move a run of their source's rows travel planar where
        # K and V are as wide ([n, b, F / 2] each); None (or MLA's widths): every pair one fused buffer
        self.runs = runs if runs is not None and k.shape[2] * k.shape[3] == v.shape[2] * v.shape[3] else None
        self._fused = None  # [L, b, F] K and V of every local row, when the steps gather from it
        # with planar runs a run costs nothing to send, so fusing every row first never pays
        self._fuse_once = fuse_sends and self.runs is None and self._fusing_once_is_cheaper()

    def sends_planar(self, dst: int) -> bool:
        """Whether our pieces for ``dst`` travel planar: we send it a run of our rows (``runs``). ``dst`` asks
        ``receives_planar`` of us and reads the same answer off its own tables."""
        return self.runs is not None and self.runs.sent_from[dst] is not None

    def receives_planar(self, src: int) -> bool:
        """Whether ``src``'s pieces for us travel planar: ``src`` sends us a run of its rows."""
        return self.runs is not None and self.runs.received_run[src]

    def _fusing_once_is_cheaper(self) -> bool:
        """A step's send buffer is K and V of its rows side by side (``fused_rows``): a run of rows is a cat
        of two views, scattered rows one gather into the buffer's halves, one op and 2 bytes moved per byte
        sent either way. Fusing every local row once moves 2 per local byte, after which a run is a view of
        it (nothing moved, no op) and scattered rows still a gather (one op, 2): no more bytes only where
        the runs a layer call sends add up to at least the local rows, and then an op fewer per run
        sent after the first.
        The caller asks for it in forward only (``fuse_sends``): backward holds the layer's peak (the
        K/V gradients in flight), where a buffer of every local row would raise it."""
        runs = sum(n for dst, n in enumerate(self.sent_to)
                   if dst != self.rank and n and self.send_index[dst] is None)
        return runs >= self.k.shape[0] > 0

    def sent_rows(self, step):
        """Local rows sent at ``step`` (a slice, or an index tensor) and their count."""
        i, j = step
        dst = (self.rank + i) % self.cp
        first, n = self.pieces.span(self.sent_to[dst], j)
        index = self.send_index[dst]  # None: every local row, in order
        if index is not None and self.sends_planar(dst):  # a run: its rows as a view, sent as they lie
            start = self.runs.sent_from[dst]
            return slice(start + first, start + first + n), n
        part = slice(first, first + n)
        return (part if index is None else index[part]), n

    def start(self, step) -> Transfer:
        i, j = step
        dst, src = (self.rank + i) % self.cp, (self.rank - i) % self.cp
        rows, n_send = self.sent_rows(step)
        sends = [(None, dst)]
        if n_send and self.sends_planar(dst):
            sends = [(half, dst) for half in planar_rows(self.k, self.v, rows)]
        elif n_send:
            sends = [(self._send_buffer(rows), dst)]
        n_recv = self.received_rows(step)
        like = self.k[:0]
        shape = (n_recv, self.k.shape[1], fused_width(self.k, self.v))
        return self.post(sends, src, shape, like, self.group, self.stats, self.prefix + "wait_seconds",
                         self.prefix + "bytes", planar=self.receives_planar(src))

    def gradients_planar(self, step) -> Tuple[bool, bool]:
        i = step[0]
        return self.receives_planar((self.rank - i) % self.cp), self.sends_planar((self.rank + i) % self.cp)


    def _send_buffer(self, rows) -> torch.Tensor:  # [n, b, F]
        if not self._fuse_once:
            return fused_rows(self.k, self.v, rows)
        if self._fused is None:
            self._fused = fused_rows(self.k, self.v, slice(None))
        return self._fused[rows] if isinstance(rows, slice) else self._fused.index_select(0, rows)

    @staticmethod
    def can_start(step) -> bool:
        """Every piece of the needed rows comes from its source's own K/V: it can be posted any time."""
        return True

    def received_rows(self, step) -> int:
        i, j = step
        return self.pieces.span(self.received_from[(self.rank - i) % self.cp], j)[1]

    # Every needed row is attended: a received chunk's gradient goes back whole.
    gradient_rows = received_rows

    def brings_nothing(self, step) -> bool:
        """Whether the fetch at ``step`` brings this rank no row (it only sends)."""
        return not self.received_rows(step)

    def received(self, chunk) -> None:
        pass


class _Batched:
    """A band group's messages posted as one batch; ``wait`` puts the arrivals in the bands' order."""

    def __init__(self, transfer: Transfer, place):
        self._transfer, self._place = transfer, place

    def wait(self) -> Optional[torch.Tensor]:
        arrived = self._transfer.wait()  # [n, b, F] source by source; None: nothing comes (the sends still wait)
        return None if arrived is None else gather(arrived, self._place)


class _PieceByPiece:
    """A band group's messages posted pair by pair; ``wait`` places each piece in the bands' order as it lands."""

    def __init__(self, transfers, rows: int, like: torch.Tensor):
        self._transfers, self._rows, self._like = transfers, rows, like

    def wait(self) -> Optional[torch.Tensor]:
        band = None  # every transfer is waited for, the sends of a rank that receives nothing too
        if self._rows:
            band = torch.empty((self._rows,) + tuple(self._like.shape[1:]), dtype=self._like.dtype,
                               device=self._like.device)
        for rows, transfer in self._transfers:
            received = transfer.wait()
            if received is not None:
                set_rows(band, rows, received)
        return band


@dataclass(frozen=True)
class GroupMessages:
    """One band group's messages, piece g of every pair; offsets are rows of its buffers, peers in rank order
    (this rank r skipped), as an all-to-all sends and lands them.

        sent:     [ to 0 | to 1 | ... | to r - 1 | to r + 1 | ... ]   local rows ``send_rows``
        arrived:  [ from 0 | from 1 | ... | from r + 1 | ... ]         band row ``band_rows[a]`` of arrival a

    Each rows field is None (every row in order), a slice (one run) or an index on the device."""

    send_rows: object  # local K/V rows sent, destination by destination
    sends: Tuple[Tuple[int, int, int, int], ...]  # (round, destination, first, rows) of the sent rows
    receives: Tuple[Tuple[int, int, int, int], ...]  # (round, source, first, rows) of the arrivals
    band_rows: object  # arrival row -> its row in the group's band buffer (the gradient's order back)
    place: object  # band row -> its arrival row: the bands' order, one gather
    sent: int  # rows sent (the gradients that come back)
    received: int  # rows received
    one_batch: bool  # posted as one batch (one gather, one placement, one gradient add), else pair by pair
    # (rows to, rows from) each rank in rank order, where the batch is one all_to_all_single (every rank
    # sends and receives in it); else None
    splits: Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]] = None

    @property
    def all_to_all(self) -> bool:
        return self.splits is not None


@dataclass(frozen=True)
class WholeDelivery:
    """What ``WholeNeededTransport`` moves for the band mode (``BlockDiagCPState.whole_delivery_on``)."""

    groups: Tuple[Tuple[Tuple[int, int], ...], ...]  # per band step, the (round, piece) of its messages, in order
    pieces: Pieces  # how a pair's rows are cut: piece g goes with band step g
    messages: Tuple[GroupMessages, ...]  # per band step

    @property
    def received(self) -> Tuple[int, ...]:
        """Per group, the rows this rank receives, every source together."""
        return tuple(m.received for m in self.messages)


class WholeNeededTransport(NeededTransport):
    """a2a / halo for the gathered plan (``gathered``: the own step, then one step per group of pieces,
    by bands). Band step g moves piece g of every pair (``GroupMessages``) one of two ways, the same on
    every rank (``BlockDiagCPState.whole_delivery_on`` says which):

    - one batch (``one_batch``): its sends gathered into one buffer, its arrivals into another, put in
      the bands' order by one gather; its gradient home the same way (one gather into the arrival order,
      one batch, one add of what comes back): a few ops a group, whatever the number of sources;
    - pair by pair: each piece gathered, posted, placed as it lands, its gradient selected, sent and
      added on its own, so the link starts with the first piece, and the last piece's placement and add
      are all that follows it.

    Every rank posts the same pairs in the same order, and every rank of the group takes the band mode
    or none does (``needed_whole``)."""

    def __init__(self, k, v, rank: int, cp: int, group, stats: Dict, prefix: str,
                 send_index: List[Optional[torch.Tensor]], counts: torch.Tensor, delivery: WholeDelivery,
                 fuse_sends: bool = False):
        super().__init__(k, v, rank, cp, delivery.pieces, group, stats, prefix, send_index, counts, fuse_sends)
        self.delivery = delivery
        self._arrival = None  # the gradient buffer handed out for the step in hand (``gradient_buffer``)

    # Where a batch goes and lands, and one pair's piece: testing.loopback hands them over instead.
    post_into = staticmethod(post_into)
    post_all_to_all = staticmethod(post_all_to_all)
    receive_buffer = staticmethod(receive_buffer)
    start_piece = NeededTransport.start

    def brings_nothing(self, step) -> bool:
        """Whether band step ``step``'s group brings this rank no row from any source."""
        return not self.delivery.messages[step[1]].received

    def _buffer(self, rows: int) -> Optional[torch.Tensor]:
        return self.receive_buffer((rows, self.k.shape[1], fused_width(self.k, self.v)), self.k) if rows else None

    @staticmethod
    def _places(m: GroupMessages) -> Dict[int, object]:
        """Per round, where its piece's rows lie in the band buffer."""
        return {i: rows_of(m.band_rows, slice(first, first + n)) for i, _, first, n in m.receives}

    def start(self, step):
        g = step[1]
        m = self.delivery.messages[g]
        if not m.one_batch:
            places = self._places(m)
            like = self.k.new_empty((0, self.k.shape[1], fused_width(self.k, self.v)))
            return _PieceByPiece([(places.get(piece[0]), self.start_piece(piece)) for piece in self.delivery.groups[g]],
                                 m.received, like)
        sent = self._send_buffer(slice(None) if m.send_rows is None else m.send_rows) if m.sent else None
        arrived = self._buffer(m.received)
        if m.all_to_all:
            to_rank, from_rank = m.splits
            return _Batched(self.post_all_to_all(sent, list(to_rank), arrived, list(from_rank), self.k[:0], self.group,
                                                 self.stats, self.prefix + "wait_seconds", self.prefix + "bytes"),
                            m.place)
        transfer = self.post_into([(sent[first:first + n], dst) for _, dst, first, n in m.sends],
                                  [(arrived[first:first + n], src) for _, src, first, n in m.receives], arrived,
                                  self.k[:0], self.group, self.stats, self.prefix + "wait_seconds",
                                  self.prefix + "bytes")
        return _Batched(transfer, m.place)

    def gradient_buffer(self, step, chunk: torch.Tensor) -> Optional[torch.Tensor]:
        """A batched group's gradient, [received, b, F] in k's dtype and unset (for calls that write every
        row), in the order its batch goes home: each call writes its band rows where they arrived
        (``gradient_places``), so no gather puts them there after. None pair by pair, where each piece
        is selected from the bands' order as it goes."""
        m = self.delivery.messages[step[1]]
        if not (m.one_batch and m.received):
            return None
        self._arrival = torch.empty((m.received,) + tuple(chunk.shape[1:]), dtype=self.k.dtype, device=self.k.device)
        return self._arrival

    def gradient_places(self, step):
        """Band row -> its arrival row (``GroupMessages.place``) for ``gradient_buffer``'s buffer."""
        m = self.delivery.messages[step[1]]
        return m.place if m.one_batch else None

    def send_gradient(self, step, grad_chunk: Optional[torch.Tensor], like: torch.Tensor):
        """The band gradient [received, b, F] home (zeros where no call attended it), ours back. Written in
        ``gradient_buffer``'s buffer, it is in the arrival order already."""
        g = step[1]
        m = self.delivery.messages[g]
        arrived = self._arrival
        self._arrival = None
        if not m.one_batch:
            places, handles = self._places(m), []
            for piece in self.delivery.groups[g]:
                rows = places.get(piece[0])
                part = None if grad_chunk is None or rows is None else gather(grad_chunk, rows)
                handles.append(_DirectGradients.send_gradient(self, piece, part, like))
            return False, handles
        grad = None
        if m.received:
            grad = (like.new_zeros((m.received,) + tuple(like.shape[1:])) if grad_chunk is None
                    else grad_chunk if arrived is not None and grad_chunk.data_ptr() == arrived.data_ptr()
                    else gather(grad_chunk, m.band_rows))
        back = self._buffer(m.sent)
        if m.all_to_all:  # every rank received in the group, and sent: both sides have rows
            to_rank, from_rank = m.splits
            transfer = self.post_all_to_all(grad, list(from_rank), back, list(to_rank), like, self.group, self.stats,
                                            "backward_wait_seconds", "backward_grad_bytes")
            return True, (transfer, g)
        transfer = self.post_into([(grad[first:first + n], src) for _, src, first, n in m.receives],
                                  [(back[first:first + n], dst) for _, dst, first, n in m.sends], back, like,
                                  self.group, self.stats, "backward_wait_seconds", "backward_grad_bytes")
        return True, (transfer, g)

    def settle(self, handle, dkv) -> None:
        one_batch, handles = handle
        if not one_batch:
            for piece in handles:
                _DirectGradients.settle(piece, dkv)
            return
        transfer, g = handles
        back = transfer.wait()
        if back is not None:
            dkv.add(self.delivery.messages[g].send_rows, back, ("group", g))


class _Slice:
    """Step (i, j)'s rows of the hierarchical buffer; the first ``wait`` finishes the routes' transfer."""

    def __init__(self, transport: "HierarchicalTransport", step):
        self._transport, self._step = transport, step

    def wait(self) -> Optional[torch.Tensor]:
        buffer = self._transport.delivered()
        first, n = self._transport._rows(self._step)
        return buffer[first:first + n] if n else None


class HierarchicalTransport:
    """The needed rows through two-level routes, posted at the first step; the steps read slices of them.

    The buffer is what ``hierarchical_exchange.RouteForward`` delivers: local rows, then the rows
    received from each source in rank order, ascending; step (i, j) reads source (rank - i)'s
    piece j. With ``whole`` (the route placing the received rows in ``gathered``'s band order)
    one step reads every received row. Stage 1 (the inter-node one) is in flight while the
    local keys are attended; the first remote step waits for it and runs stage 2 inside the
    node. Gradients collect in a buffer of the same shape (``whole``: written there by the
    step's calls, ``gradient_buffer``) and go back through the routes once, at the end.
    """

    kind = "needed"

    def __init__(self, k, v, rank: int, cp: int, chunk_rows: int, group, stats: Dict, prefix: str,
                 counts: torch.Tensor, route, whole: bool = False):
        self.k, self.v, self.rank, self.cp, self.c = k, v, rank, cp, chunk_rows
        self.whole = whole  # one remote step reads every received row (``gathered``)
        self.group, self.stats, self.prefix, self.route = group, stats, prefix, route
        received = counts[:, rank].tolist()  # host ints: no tensor op per layer call
        received[rank] = 0
        self.offset = list(accumulate(received, initial=0))[:cp]  # per source, in the buffer past local
        self.from_source = received
        self._moving = None  # RouteForward in flight
        self._buffer = None
        self._grad = None

    def _rows(self, step):
        if self.whole:
            return self.k.shape[0], sum(self.from_source)
        i, j = step
        src = (self.rank - i) % self.cp
        n = piece_rows(self.from_source[src], self.c, j)
        first = self.k.shape[0] + self.offset[src] + j * self.c
        return first, n

    def start(self, step) -> _Slice:
        if self._moving is None and self._buffer is None:
            # the steps read the received rows only (the local keys are attended from k and v): stage 1's
            # rows are gathered straight from k and v (none, and no op, where it moves nothing), and the
            # buffer's local rows stay unwritten
            self._moving = RouteForward(fused_rows(self.k, self.v, self.route.send1_index), self.route, self.group,
                                        False, {})
        return _Slice(self, step)

    def delivered(self) -> torch.Tensor:
        if self._buffer is None:
            moving, self._moving = self._moving, None
            with exposed_wait(self.stats, self.prefix + "wait_seconds", self.k.device):
                self._buffer = moving.wait()
            for key in ("bytes_sent", "bytes_received", "bytes_inter_node_sent", "bytes_inter_node_received"):
                self.stats[self.prefix + key] = self.stats.get(self.prefix + key, 0) + moving.stats[key]
        return self._buffer

    def received(self, chunk) -> None:
        pass

    @staticmethod
    def can_start(step) -> bool:
        return True

    def gradient_buffer(self, step, chunk: torch.Tensor) -> Optional[torch.Tensor]:
        """Where the whole step writes its chunk's gradient ([n, b, F], k's dtype): its rows of the buffer
        the routes send back, so nothing is copied; unset, for calls that write every row. None without
        ``whole``."""
        if not self.whole:
            return None
        if self._grad is None:  # every received row is written by the step: nothing to zero
            self._grad = torch.empty((self.route.out_rows,) + tuple(chunk.shape[1:]), dtype=self.k.dtype,
                                     device=self.k.device)
        first, n = self._rows(step)
        return self._grad[first:first + n]

    @staticmethod
    def gradient_places(step) -> None:
        """The routes place the rows in the bands' order: ``gradient_buffer``'s rows are the chunk's."""
        return None

    def send_gradient(self, step, grad_chunk: Optional[torch.Tensor], like: torch.Tensor):
        if grad_chunk is not None:
            first, n = self._rows(step)
            if self._grad is not None and grad_chunk.data_ptr() == self._grad[first:first + n].data_ptr():
                return None  # written in place (``gradient_buffer``)
            if self._grad is None:
                self._grad = self._received_grad(grad_chunk.shape[1:], grad_chunk.dtype)
            self._grad[first:first + n] += grad_chunk
        return None

    @staticmethod
    def settle(handle, dkv) -> None:
        pass

    def _received_grad(self, tail, dtype) -> torch.Tensor:
        """[out_rows, b, F] gradients of the buffer: zeros past the local rows, which ``returned_rows`` never
        reads (the own keys' gradients collect in ``KeyGradients``)."""
        grad = torch.empty((self.route.out_rows,) + tuple(tail), dtype=dtype, device=self.k.device)
        grad[self.k.shape[0]:].zero_()
        return grad

    def finish(self, dkv) -> None:
        """Every chunk's gradient back through the routes at once; the rows that come home (those this rank
        sent in stage 1) added into ``dkv`` (``merge.KeyGradients``)."""
        if self._moving is not None:  # save mode never reads the refetch it did not post; nothing is pending
            self.delivered()
        if self._grad is None:  # every rank takes part in the routes' transfers, gradient or not
            self._grad = self._received_grad((self.k.shape[1], fused_width(self.k, self.v)), self.k.dtype)
        moved: Dict = {}
        with exposed_wait(self.stats, "backward_wait_seconds", self.k.device):
            back = returned_rows(self._grad, self.route, self.group, False, moved)
        if back is not None:
            dkv.add(self.route.send1_index, back, "route")
        for key in ("grad_bytes_sent", "grad_bytes_received"):
            self.stats["backward_" + key] = self.stats.get("backward_" + key, 0) + moved[key]


@dataclass(frozen=True)
class RingGradients:
    """The ring's (round, piece) steps that move a K/V gradient, for one rank.

    At step (i, j) rank r holds piece j (local rows [j c, (j + 1) c)) of source r - i; its
    gradient is non-zero only where r attends one of those keys, so only where r needs one
    of those rows. ``sent``: the steps whose chunk gradient r sends home. ``returned``: the
    steps whose gradient of r's own piece j comes back from r + i.
    """

    sent: FrozenSet[Tuple[int, int]]
    returned: FrozenSet[Tuple[int, int]]

    @classmethod
    def of(cls, plan, runs, chunk_rows: int) -> "RingGradients":
        """From the step plan's needed exchange (``plan.exchange``) and the layout's runs.

        A sender reads the positions it receives from a source, its home the rows it sends to
        that rank: the two ends of one needed exchange, so both take the same decision without
        communication.
        """
        rank, cp, L = plan.rank, plan.cp, plan.local_len
        sent, returned = set(), set()
        for i in range(1, cp):
            src, dst = (rank - i) % cp, (rank + i) % cp
            positions = plan.exchange.recv_positions[src]  # global, owned by src
            if positions.numel():
                local = runs.flat_before_np(positions.numpy(), src) - src * L  # their rows on src
                sent.update((i, j) for j in np.unique(local // chunk_rows).tolist())
            rows = plan.exchange.send_index[dst]
            if rows.numel():
                returned.update((i, j) for j in np.unique(rows.numpy() // chunk_rows).tolist())
        return cls(frozenset(sent), frozenset(returned))


def return_gradient(grad_chunk, round_index: int, incoming_rows: int, rank: int, cp: int, like: torch.Tensor,
                    group, stats: Dict, post=post, planar_out: bool = False, planar_in: bool = False) -> Transfer:
    """Send a chunk's K/V gradient to its source (rank - i); receive ours from rank + i.

    ``like``: a [*, b, F] tensor of the gradients' dtype and device; ``post``: where the transfers go.
    ``planar_out``: ``grad_chunk`` is (dK, dV) rows, sent as two messages; ``planar_in``: ours comes back
    so, into a [2, n, b, F / 2] buffer.
    """
    src, dst = (rank - round_index) % cp, (rank + round_index) % cp
    sends = [(half, src) for half in grad_chunk] if planar_out and grad_chunk is not None else [(grad_chunk, src)]
    return post(sends, dst, (incoming_rows,) + tuple(like.shape[1:]), like, group, stats, "backward_wait_seconds",
                "backward_grad_bytes", planar=planar_in)


__all__ = ["RingTransport", "RingGradients", "RingReach", "NeededTransport", "WholeNeededTransport", "WholeDelivery", "GroupMessages", "HierarchicalTransport", "Transfer", "post", "post_into", "post_all_to_all", "receive_buffer", "return_gradient", "fused_rows", "fused_width", "planar_rows",
           "exposed_wait", "resolve_waits", "Pieces", "stage_collectives_on_cpu", "STAGE_COLLECTIVES_ENV"]
