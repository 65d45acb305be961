"""The hierarchical needed-only K/V exchange: a node's remote rows cross InfiniBand once.

``hierarchical_needed_kv(kv, route, group, stats)`` returns exactly the needed-only buffer
(this rank's local rows, then the received rows grouped
by source rank in rank order, ascending global position within a source), but
moves them in two stages (``hierarchy.HierarchicalRoute``):

1. one exchange over the CP group: rows to the ranks of this node that need
   them, and rows a remote node needs to the fetcher of that node's window;
2. inside the node: each fetcher forwards what it fetched to the ranks that need it.

Backward runs the stages in reverse: gradients of forwarded rows go back to
their fetcher, which sums them with its own use and sends the sums to the
owners; an owner index-adds what comes back (a row used by several ranks sums
their gradients). Whether a stage moves anything is decided from the global
routes, so every rank issues the same collectives.
"""

import math
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .hierarchy import HierarchicalRoute
from .merge_kernel import copy_rows_


class _Moving:
    """One stage's all-to-all-v (or p2p) in flight; ``wait`` returns the rows grouped by source."""

    def __init__(self, send: torch.Tensor, send_counts: List[int], recv_counts: List[int], group, use_p2p: bool):
        self.recv = send.new_empty((sum(recv_counts),) + tuple(send.shape[1:]))
        send = send.contiguous()  # kept alive until the transfer is done
        self._keep = send
        if not use_p2p:
            self._requests = [dist.all_to_all_single(self.recv, send, output_split_sizes=recv_counts,
                                                     input_split_sizes=send_counts, group=group, async_op=True)]
            return
        ranks = dist.get_process_group_ranks(group)
        ops = [dist.P2POp(dist.irecv, chunk, ranks[peer], group)
               for peer, (chunk, n) in enumerate(zip(self.recv.split(recv_counts), recv_counts)) if n]
        ops += [dist.P2POp(dist.isend, chunk, ranks[peer], group)
                for peer, (chunk, n) in enumerate(zip(send.split(send_counts), send_counts)) if n]
        self._requests = dist.batch_isend_irecv(ops) if ops else []

    def wait(self) -> torch.Tensor:
        for req in self._requests:
            req.wait()
        self._requests, self._keep = [], None
        return self.recv


def _move(send: torch.Tensor, send_counts: List[int], recv_counts: List[int], group, use_p2p: bool) -> torch.Tensor:
    """Rows grouped by destination -> rows grouped by source (all-to-all-v, or p2p with the non-empty peers)."""
    return _Moving(send, send_counts, recv_counts, group, use_p2p).wait()


class RouteForward:
    """``route_forward`` split in two: the constructor posts stage 1, ``wait`` finishes it.

    Stage 1 (the only stage that crosses nodes) is in flight while the caller computes
    (the streamed op attends its local keys meanwhile); stage 2, inside the node, needs
    stage 1's rows, so it runs in ``wait``.

    ``send1`` [sum(route.send1_counts), b, F]: what stage 1 sends, the local rows ``route.send1_index``
    (the caller gathers them where they lie: the streamed op straight from k and v, in one pass).
    ``local`` [L, b, F]: copied into the buffer's first L rows; None leaves them unwritten.
    """

    def __init__(self, send1: torch.Tensor, route: HierarchicalRoute, group, use_p2p: bool, stats: Dict,
                 local: Optional[torch.Tensor] = None):
        self.route, self.group, self.use_p2p, self.stats, self.local = route, group, use_p2p, stats, local
        self.like = send1.new_empty((0,) + tuple(send1.shape[1:]))  # not a view: send1 is freed after stage 1
        self._stage1 = (_Moving(send1, route.send1_counts, route.recv1_counts, group, use_p2p)
                        if route.stage1_moves else None)

    def wait(self) -> torch.Tensor:
        """[L + needed, b, F]: local rows (unwritten without ``local``), then the received rows by source."""
        route, like = self.route, self.like
        tail = tuple(like.shape[1:])
        recv1 = self._stage1.wait() if self._stage1 is not None else like
        recv2 = like
        if route.stage2_moves:
            recv2 = _move(recv1.index_select(0, route.send2_index), route.send2_counts, route.recv2_counts,
                          self.group, self.use_p2p)
        out = like.new_empty((route.out_rows,) + tail)
        if self.local is not None:
            out[:route.local_len] = self.local
        if route.kept1.numel():  # gathered from stage 1's rows and placed in one pass
            copy_rows_(out, recv1, route.kept1, route.kept1_slot)
        out.index_copy_(0, route.slot2, recv2)
        row = math.prod(tail) * like.element_size()
        sent = sum(route.send1_counts) + sum(route.send2_counts)
        received = sum(route.recv1_counts) + sum(route.recv2_counts)
        self.stats.update(bytes_sent=sent * row, bytes_received=received * row,
                          bytes_inter_node_sent=route.inter1_send * row,
                          bytes_inter_node_received=route.inter1_recv * row,
                          bytes_intra_node_sent=(sent - route.inter1_send) * row,
                          bytes_intra_node_received=(received - route.inter1_recv) * row)
        self.local = None
        return out


def route_forward(kv: torch.Tensor, route: HierarchicalRoute, group, use_p2p: bool, stats: Dict) -> torch.Tensor:
    """[L, b, F] -> [L + needed, b, F] through the two stages (no autograd)."""
    send1 = kv.index_select(0, route.send1_index) if route.stage1_moves else kv[:0]
    return RouteForward(send1, route, group, use_p2p, stats, local=kv).wait()


def returned_rows(grad: torch.Tensor, route: HierarchicalRoute, group, use_p2p: bool,
                  stats: Optional[Dict] = None) -> Optional[torch.Tensor]:
    """The received rows' part of ``route_backward``: [sum(send1_counts), b, F], the gradient of each
    row this rank sent in stage 1 (rows of ``route.send1_index``, which may repeat), or None when no
    stage moves anything. The local rows' part (``grad[:L]``) is not read.

    ``stats`` gets grad_bytes_sent / grad_bytes_received: the gradient rows both stages moved.
    """
    if stats is not None:
        row = grad[0].numel() * grad.element_size() if grad.shape[0] else 0
        stats.update(grad_bytes_sent=(sum(route.recv1_counts) + sum(route.recv2_counts)) * row,
                     grad_bytes_received=(sum(route.send1_counts) + sum(route.send2_counts)) * row)
    tail = tuple(grad.shape[1:])
    if route.kept1.numel() == route.slot1.numel():  # every stage-1 row is needed here: one gather, no zeros
        grad1 = grad.index_select(0, route.kept1_slot)
    else:
        grad1 = grad.new_zeros((int(route.slot1.numel()),) + tail)  # rows fetched for the node only stay 0
        if route.kept1.numel():
            copy_rows_(grad1, grad, route.kept1_slot, route.kept1)
    if route.stage2_moves:
        back2 = _move(grad.index_select(0, route.slot2), route.recv2_counts, route.send2_counts, group, use_p2p)
        grad1.index_add_(0, route.send2_index, back2)  # the fetcher sums its peers' grads with its own
    if not route.stage1_moves:
        return None
    return _move(grad1, route.recv1_counts, route.send1_counts, group, use_p2p)


def route_backward(grad: torch.Tensor, route: HierarchicalRoute, group, use_p2p: bool,
                   stats: Optional[Dict] = None) -> torch.Tensor:
    """The gradient of ``route_forward``: [L + needed, b, F] -> [L, b, F], stages reversed (no autograd).

    ``stats`` gets grad_bytes_sent / grad_bytes_received: the gradient rows both stages moved.
    """
    grad = grad.contiguous()
    grad_kv = grad[:route.local_len].clone()
    back1 = returned_rows(grad, route, group, use_p2p, stats)
    if back1 is not None:
        grad_kv.index_add_(0, route.send1_index, back1)  # an owner sums every rank's grads of a row
    return grad_kv


class _HierarchicalKV(torch.autograd.Function):
    """Forward: ``route_forward``. Backward: ``route_backward``."""

    @staticmethod
    def forward(ctx, kv, route: HierarchicalRoute, group, use_p2p: bool, stats: Dict):
        ctx.route, ctx.group, ctx.use_p2p = route, group, use_p2p
        return route_forward(kv, route, group, use_p2p, stats)

    @staticmethod
    def backward(ctx, grad):
        return route_backward(grad, ctx.route, ctx.group, ctx.use_p2p), None, None, None, None


def hierarchical_needed_kv(kv: torch.Tensor, route: HierarchicalRoute, group, stats: Optional[Dict] = None,
                           use_p2p: bool = False) -> torch.Tensor:
    """[L, b, F] -> [L + needed, b, F]: the needed-only buffer, moved through the node routes.

    ``route``: this rank's ``hierarchy.HierarchicalRoute`` (``route.to(kv.device)`` once per
    step). ``stats`` gets bytes_sent / bytes_received (both stages) and their
    inter-node (stage 1 across nodes) and intra-node parts. ``use_p2p``: batched
    isend/irecv with the non-empty peers instead of all-to-all-v.
    """
    if kv.shape[0] != route.local_len:
        raise ValueError(f"hierarchical_needed_kv: kv has {kv.shape[0]} rows, the route is for local_len "
                         f"{route.local_len}")
    if route.send1_index.device != kv.device:
        route = route.to(kv.device)
    stats = {} if stats is None else stats
    return _HierarchicalKV.apply(kv, route, group, use_p2p, stats)


__all__ = ["hierarchical_needed_kv", "returned_rows", "route_backward"]
