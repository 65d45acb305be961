"""K/V transports for the streamed op: one round at a time over p2p, in flight while compute runs.

A step moves one chunk of K/V to every rank at once (``chunks``): at step (i, j),
rank r receives piece j of the K/V of source (r - i) mod cp. Two transports deliver it:

    ring (allgather)     r sends r + 1 the piece it received at step (i - 1, j) (its own
                         piece j at i = 1) and receives from r - 1: every rank's whole local
                         K/V travels around the ring, neighbour links only (TE's p2p CP)

        step (1, j):  0 -> 1 -> 2 -> 3 -> 0      piece j of r - 1
        step (2, j):  the same links, forwarding  piece j of r - 2 ...

    needed (a2a, halo)   r sends r + i piece j of the rows of its own K/V that r + i needs and
                         receives from r - i piece j of the rows it needs: exactly the
                         needed-only lower bound, a step with nothing either way posts nothing

K and V travel fused in one buffer per step, [n, b, Hkv * (Dk + Dv)], built per piece
(never a fused copy of the whole shard).

Backward sends each chunk's K/V gradient straight home (to r - i, from r + i),
and with ``kv_backward="refetch"`` moves the chunks again the same way instead
of keeping them. Every transfer is counted from the tensors actually moved, and
the time a rank spends waiting for a transfer (what compute did not hide) is
recorded as exposed communication.
"""

import os
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

# Opt-in: run the K/V transfers on CPU copies of device tensors. For gloo groups whose ranks
# share one GPU (NCCL refuses two ranks on one device; gloo's send/recv hands the raw device
# pointer to its TCP transport). Costs a device->host and a host->device copy per transfer.
STAGE_COLLECTIVES_ENV = "MEGATRON_EXT_STAGE_COLLECTIVES_ON_CPU"


def stage_collectives_on_cpu() -> bool:
    return os.environ.get(STAGE_COLLECTIVES_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def _nbytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class Transfer:
    """Posted sends/receives of one round; ``wait`` returns the received tensor (None: nothing)."""

    def __init__(self, requests, received: Optional[torch.Tensor], device, stats: Dict, key: str):
        self._requests, self._received, self._device = requests, received, device
        self._stats, self._key = stats, key

    def wait(self) -> Optional[torch.Tensor]:
        """The received tensor (None when nothing was received), after every transfer finished."""
        start = time.perf_counter()
        for req in self._requests:
            req.wait()
        self._stats[self._key] = self._stats.get(self._key, 0.0) + time.perf_counter() - start
        self._requests = []
        received = self._received
        if received is not None and received.device != self._device:
            received = received.to(self._device)  # staged through the CPU
        return received


def post(sends, recv_from: Optional[int], recv_shape, like: torch.Tensor, group, stats: Dict,
         wait_key: str, byte_key: str) -> Transfer:
    """Post this rank's sends [(tensor, group rank)] and one receive; nothing to do posts nothing.

    Every rank of a round calls ``post`` once, with matching sends and receives, so
    each pair's transfers pair up in order; empty transfers are never posted.
    """
    staged = like.device.type != "cpu" and stage_collectives_on_cpu()
    recv_shape = tuple(recv_shape)
    ranks = dist.get_process_group_ranks(group)
    ops, received = [], None
    if recv_from is not None and recv_shape[0] > 0:
        received = torch.empty(recv_shape, dtype=like.dtype, device="cpu" if staged else like.device)
        ops.append(dist.P2POp(dist.irecv, received, ranks[recv_from], group))
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


def fused_rows(k: torch.Tensor, v: torch.Tensor, rows) -> torch.Tensor:
    """[n, b, Hkv * (Dk + Dv)]: K and V of local ``rows`` (a slice or an index tensor) in one buffer."""
    k, v = (t[rows] if isinstance(rows, slice) else t.index_select(0, rows) for t in (k, v))
    return torch.cat([k, v], dim=-1).view(k.shape[0], k.shape[1], -1)


class RingTransport:
    """allgather as a ring: step (i, j) forwards piece j of the chunk received at (i - 1, j) to rank + 1."""

    kind = "ring"

    def __init__(self, k, v, rank: int, cp: int, chunk_rows: int, group, stats: Dict, prefix: str):
        self.k, self.v, self.rank, self.cp, self.c = k, v, rank, cp, chunk_rows
        self.group, self.stats, self.prefix = group, stats, prefix
        self._last = None  # the piece received last step: forwarded next step

    def rows(self, piece: int) -> int:
        return max(0, min(self.c, self.k.shape[0] - piece * self.c))

    def start(self, step) -> Transfer:
        i, j = step
        send = fused_rows(self.k, self.v, slice(j * self.c, (j + 1) * self.c)) if i == 1 else self._last
        n = self.rows(j)
        return post([(send, (self.rank + 1) % self.cp)], (self.rank - 1) % self.cp,
                    (n,) + send.shape[1:], send, self.group, self.stats, self.prefix + "wait_seconds",
                    self.prefix + "bytes")

    def received(self, chunk: torch.Tensor) -> None:
        self._last = chunk

    def sent_rows(self, step):
        """What this rank sent at ``step`` for its own K/V (whose gradient comes back): rows, count."""
        i, j = step
        return slice(j * self.c, j * self.c + self.rows(j)), self.rows(j)


class NeededTransport:
    """a2a / halo: step (i, j) sends rank + i piece j of its needed rows, receives piece j from rank - i."""

    kind = "needed"

    def __init__(self, k, v, rank: int, cp: int, chunk_rows: int, group, stats: Dict, prefix: str,
                 send_index: List[Optional[torch.Tensor]], counts: torch.Tensor):
        self.k, self.v, self.rank, self.cp, self.c = k, v, rank, cp, chunk_rows
        self.group, self.stats, self.prefix = group, stats, prefix
        self.send_index, self.counts = send_index, counts

    def _piece(self, count: int, j: int) -> int:
        return max(0, min(self.c, count - j * self.c))

    def sent_rows(self, step):
        """Local rows sent at ``step`` (a slice, or an index tensor) and their count."""
        i, j = step
        dst = (self.rank + i) % self.cp
        n = self._piece(int(self.counts[self.rank, dst]), j)
        index = self.send_index[dst]  # None: every local row, in order
        part = slice(j * self.c, j * self.c + n)
        return (part if index is None else index[part]), n

    def start(self, step) -> Transfer:
        i, j = step
        dst, src = (self.rank + i) % self.cp, (self.rank - i) % self.cp
        rows, n_send = self.sent_rows(step)
        send = fused_rows(self.k, self.v, rows) if n_send else None
        n_recv = self._piece(int(self.counts[src, self.rank]), j)
        like = self.k[:0]
        shape = (n_recv, self.k.shape[1], self.k.shape[2] * self.k.shape[3] + self.v.shape[2] * self.v.shape[3])
        return post([(send, dst)], src, shape, like, self.group, self.stats, self.prefix + "wait_seconds",
                    self.prefix + "bytes")

    def received(self, chunk) -> None:
        pass


def return_gradient(grad_chunk: Optional[torch.Tensor], round_index: int, incoming_rows: int, rank: int,
                    cp: int, like: torch.Tensor, group, stats: Dict) -> Transfer:
    """Send a chunk's K/V gradient to its source (rank - i); receive ours from rank + i.

    ``like``: a [*, b, F] tensor of the gradients' dtype and device.
    """
    src, dst = (rank - round_index) % cp, (rank + round_index) % cp
    return post([(grad_chunk, src)], dst, (incoming_rows,) + tuple(like.shape[1:]), like, group, stats,
                "backward_wait_seconds", "backward_grad_bytes")


__all__ = ["RingTransport", "NeededTransport", "Transfer", "post", "return_gradient", "fused_rows",
           "stage_collectives_on_cpu", "STAGE_COLLECTIVES_ENV"]
