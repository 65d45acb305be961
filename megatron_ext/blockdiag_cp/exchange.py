"""Differentiable K/V collectives over the CP group: all-gather, halo p2p, needed-only a2a-v.

Every function takes this rank's fused K/V rows ``kv`` [L, b, F] and returns the
rows the plan's kernel segments index. Each records the bytes it moved in the
``stats`` dict it is given (counted from the tensors actually sent), so reported
traffic is measured, not modelled.
"""

import os
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

# Opt-in: run the K/V collectives on CPU copies of device tensors. For gloo groups whose ranks
# share one GPU (NCCL refuses two ranks on one device; gloo's send/recv hands the raw device
# pointer to its TCP transport). Costs a device->host and a host->device copy per collective.
STAGE_COLLECTIVES_ENV = "MEGATRON_EXT_STAGE_COLLECTIVES_ON_CPU"


def stage_collectives_on_cpu() -> bool:
    return os.environ.get(STAGE_COLLECTIVES_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def _staged(fn, t: torch.Tensor, *args):
    """fn(t, *args), through a CPU copy of t when staging is on and t is not on the CPU."""
    if t.device.type != "cpu" and stage_collectives_on_cpu():
        return fn(t.cpu(), *args).to(t.device)
    return fn(t, *args)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _gather_rows(kv: torch.Tensor, group) -> torch.Tensor:
    out = kv.new_empty((dist.get_world_size(group) * kv.shape[0],) + tuple(kv.shape[1:]))
    dist.all_gather_into_tensor(out, kv, group=group)  # flat output: gloo refuses stacked
    return out


def _scatter_rows(grad: torch.Tensor, group) -> torch.Tensor:
    out = grad.new_empty((grad.shape[0] // dist.get_world_size(group),) + tuple(grad.shape[1:]))
    dist.reduce_scatter_tensor(out, grad, op=dist.ReduceOp.SUM, group=group)
    return out


class _AllGatherKV(torch.autograd.Function):
    """Forward: all-gather local rows, rank-major. Backward: reduce-scatter (sum) of the gradient."""

    @staticmethod
    def forward(ctx, kv, group):
        ctx.group = group
        return _staged(_gather_rows, kv.contiguous(), group)  # [cp * L, b, F]

    @staticmethod
    def backward(ctx, grad):
        return _staged(_scatter_rows, grad.contiguous(), ctx.group), None


def _sparse_transport(send: torch.Tensor, send_counts: List[int], recv_counts: List[int],
                      group, use_p2p: bool) -> torch.Tensor:
    """Move ``send`` (rows grouped by destination) and return rows grouped by source."""
    if send.device.type != "cpu" and stage_collectives_on_cpu():
        return _sparse_transport(send.cpu(), send_counts, recv_counts, group, use_p2p).to(send.device)
    recv = send.new_empty((sum(recv_counts),) + tuple(send.shape[1:]))
    if not use_p2p:
        dist.all_to_all_single(recv, send.contiguous(), output_split_sizes=recv_counts,
                               input_split_sizes=send_counts, group=group)
        return recv
    ranks = dist.get_process_group_ranks(group)
    ops = []
    for peer, (chunk, n) in enumerate(zip(recv.split(recv_counts), recv_counts)):
        if n:
            ops.append(dist.P2POp(dist.irecv, chunk, ranks[peer], group))
    for peer, (chunk, n) in enumerate(zip(send.split(send_counts), send_counts)):
        if n:
            ops.append(dist.P2POp(dist.isend, chunk.contiguous(), ranks[peer], group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return recv


class _SparseExchangeKV(torch.autograd.Function):
    """Forward: send the needed rows to the ranks that need them. Backward: reverse send, index-add."""

    @staticmethod
    def forward(ctx, kv, send_index, send_counts, recv_counts, group, use_p2p, stats):
        ctx.save_for_backward(send_index)
        ctx.meta = (kv.shape[0], send_counts, recv_counts, group, use_p2p)
        send = kv.index_select(0, send_index)  # [sum(send_counts), b, F]
        recv = _sparse_transport(send, send_counts, recv_counts, group, use_p2p)
        stats["bytes_sent"], stats["bytes_received"] = _nbytes(send), _nbytes(recv)
        return recv

    @staticmethod
    def backward(ctx, grad):
        (send_index,) = ctx.saved_tensors
        local_len, send_counts, recv_counts, group, use_p2p = ctx.meta
        grad_send = _sparse_transport(grad.contiguous(), recv_counts, send_counts, group, use_p2p)
        grad_kv = grad.new_zeros((local_len,) + tuple(grad.shape[1:]))
        grad_kv.index_add_(0, send_index, grad_send)  # a row sent to several ranks sums their grads
        return grad_kv, None, None, None, None, None, None


def allgather_kv(kv: torch.Tensor, group, stats: Optional[Dict] = None) -> torch.Tensor:
    """[L, b, F] -> [cp * L, b, F]: every rank's rows, rank-major."""
    out = _AllGatherKV.apply(kv, group)
    if stats is not None:
        # Logical traffic: each rank's rows reach the cp - 1 others, whatever the algorithm.
        stats["bytes_sent"] = (dist.get_world_size(group) - 1) * _nbytes(kv)
        stats["bytes_received"] = _nbytes(out) - _nbytes(kv)
    return out


def needed_kv(kv: torch.Tensor, send_index: torch.Tensor, counts: torch.Tensor, rank: int,
              group, use_p2p: bool, stats: Optional[Dict] = None) -> torch.Tensor:
    """[L, b, F] -> [L + received, b, F]: local rows, then the received ones grouped by source.

    ``send_index``: local rows to send, grouped by destination (on kv's device).
    ``counts[src, dst]`` is the global send table (identical on every rank), so
    whether anything moves at all is decided the same way everywhere.
    """
    send_counts = counts[rank].tolist()
    recv_counts = counts[:, rank].tolist()
    index = send_index
    stats = {} if stats is None else stats
    if int(counts.sum()) == 0:
        stats["bytes_sent"] = stats["bytes_received"] = 0
        return kv
    received = _SparseExchangeKV.apply(kv, index, send_counts, recv_counts, group, use_p2p, stats)
    return torch.cat([kv, received], dim=0)
