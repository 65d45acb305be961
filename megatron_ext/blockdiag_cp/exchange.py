"""K/V transports for the streamed op: one round at a time over p2p, in flight while compute runs.

A round moves one chunk of K/V to every rank at once (``chunks``): in round i,
rank r receives the chunk of source (r - i) mod cp. Two transports deliver it:

    ring (allgather)     r sends r + 1 the chunk it received in round i - 1 (its own K/V in
                         round 1) and receives from r - 1: every rank's whole local K/V
                         travels around the ring, neighbour links only (TE's p2p CP)

        round 1:  0 -> 1 -> 2 -> 3 -> 0      chunk of r - 1
        round 2:  the same links, forwarding  chunk of r - 2 ...

    needed (a2a, halo)   r sends r + i the rows of its own K/V that r + i needs and receives
                         from r - i the rows it needs: exactly the needed-only lower bound,
                         a round with nothing either way posts nothing

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


class RingTransport:
    """allgather as a ring: round i forwards the chunk of round i - 1 to rank + 1."""

    kind = "ring"

    def __init__(self, kv: torch.Tensor, rank: int, cp: int, group, stats: Dict, prefix: str):
        self.kv, self.rank, self.cp, self.group, self.stats = kv, rank, cp, group, stats
        self.prefix = prefix
        self._last = kv  # what the next round forwards

    def start(self, round_index: int) -> Transfer:
        return post([(self._last, (self.rank + 1) % self.cp)], (self.rank - 1) % self.cp,
                        self.kv.shape, self.kv, self.group, self.stats, self.prefix + "wait_seconds",
                        self.prefix + "bytes")

    def received(self, chunk: torch.Tensor) -> None:
        self._last = chunk  # forwarded next round


class NeededTransport:
    """a2a / halo: round i sends rank + i its needed rows, receives the rows it needs from rank - i."""

    kind = "needed"

    def __init__(self, kv: torch.Tensor, rank: int, cp: int, group, stats: Dict, prefix: str,
                 send_index: List[torch.Tensor], counts: torch.Tensor):
        self.kv, self.rank, self.cp, self.group, self.stats = kv, rank, cp, group, stats
        self.prefix, self.send_index, self.counts = prefix, send_index, counts

    def start(self, round_index: int) -> Transfer:
        dst, src = (self.rank + round_index) % self.cp, (self.rank - round_index) % self.cp
        index = self.send_index[dst]
        send = self.kv.index_select(0, index) if index.numel() else None
        n = int(self.counts[src, self.rank])
        return post([(send, dst)], src, (n,) + tuple(self.kv.shape[1:]), self.kv, self.group, self.stats,
                    self.prefix + "wait_seconds", self.prefix + "bytes")

    def received(self, chunk) -> None:
        pass


def return_gradient(grad_chunk: Optional[torch.Tensor], round_index: int, incoming_rows: int, rank: int,
                    cp: int, like: torch.Tensor, group, stats: Dict) -> Transfer:
    """Send a chunk's K/V gradient to its source (rank - i); receive ours from rank + i."""
    src, dst = (rank - round_index) % cp, (rank + round_index) % cp
    return post([(grad_chunk, src)], dst, (incoming_rows,) + tuple(like.shape[1:]), like, group, stats,
                "backward_wait_seconds", "backward_grad_bytes")


__all__ = ["RingTransport", "NeededTransport", "Transfer", "post", "return_gradient",
           "stage_collectives_on_cpu", "STAGE_COLLECTIVES_ENV"]
