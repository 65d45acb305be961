"""blockdiag_cp_attention(): stream the needed K/V chunk by chunk, merge by log-sum-exp.

One autograd op per attention call (``_StreamedAttention``). Forward attends this
rank's queries to its own K/V while the first remote chunk is in flight, then to
each remote chunk as it arrives (``chunks``: one chunk per source rank, at most two
varlen kernel calls each), merging the partial outputs by their log-sum-exp
(online softmax); the next chunk moves while the current one computes. Backward
keeps only local q, k, v, the output and the log-sum-exp: it moves the chunks
again (``kv_backward="refetch"``, memory O(S / cp)) or reads the ones forward kept
(``"save"``), differentiates each chunk with the kernel's backward against the
final output and log-sum-exp, and sends each chunk's K/V gradient home (the ring:
only the pieces this rank needs rows of; the others' gradients are zero).

The first call of a step's state, and every new q/k/v shape after it, runs one
small agreement all-reduce of the q/k/v signature (with the softmax scale, the
dropout, the window and the sink), so a rank whose tensors or arguments are off
raises with its peers instead of leaving them waiting in the exchange; the
calls after that run no collective besides the K/V transfers and no host sync
(``MEGATRON_EXT_CP_CHECK_EVERY_CALL=1`` agrees on every call, for debugging). A
kernel that fails never stops a rank half-way (its peers would wait in the
transfers): the failure is recorded, the call contributes zeros, every transfer
still runs, and every rank raises it at the next agreement point.
"""

import logging
import os
import struct
import time
from collections import deque
from typing import List, Optional, Tuple

import torch

from .. import parallel_state as ps
from . import kernels
from .agreement import (
    INVALID_ARGUMENTS,
    INVALID_NO_STATE,
    KIND_QKV,
    PENDING_KERNEL_FAILURES,
    BlockDiagCPError,
    agree,
    raised_on_every_rank,
)
from .backend import call_backend
from .chunks import chunk_kind
from .exchange import HierarchicalTransport, NeededTransport, Pieces, RingTransport, WholeNeededTransport
from .merge import (Accumulator, KeyGradients, Result, add_rows as _add_rows, gather as _gather, rows_of as _rows_of,
                    set_rows as _set_rows)
from .resolve import resolve_step_state
from .state import count_cp_attn_fire
from .relayout import relaid_attention
from .ulysses import ulysses_attention

logger = logging.getLogger("megatron_ext.blockdiag_cp")

_DTYPE_CODES = {torch.float64: 1, torch.float32: 2, torch.float16: 3, torch.bfloat16: 4}
CHECK_EVERY_CALL_ENV = "MEGATRON_EXT_CP_CHECK_EVERY_CALL"


def check_every_call() -> bool:
    return os.environ.get(CHECK_EVERY_CALL_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


class _Geometry:
    """How one call's tensors flatten for the kernels.

    Rows with their own doc ids flatten into tokens (``s * R + row``); shared ids
    fold the batch into heads. A remote chunk is K and V fused, [n, b, Hkv * (Dk + Dv)].
    """

    def __init__(self, q, k, v, rows: int):
        self.L, self.b, self.hq, self.dk = q.shape
        self.hkv, self.dv = k.shape[2], v.shape[-1]
        self.R = rows
        self.g = self.b // rows

    def q_flat(self, q):  # [L, b, Hq, D] -> [L * R, g * Hq, D]
        return q.reshape(self.L * self.R, self.g * self.hq, q.shape[-1])

    def kv_flat(self, t):  # own k or v [L, b, Hkv, D] -> [L * R, g * Hkv, D]
        return t.reshape(self.L * self.R, self.g * self.hkv, t.shape[-1])

    def split(self, chunk):  # [n, b, F] -> k [n * R, g * Hkv, Dk], v [n * R, g * Hkv, Dv] (views)
        flat = chunk.view(chunk.shape[0] * self.R, self.g * self.hkv, self.dk + self.dv)
        return flat[..., :self.dk], flat[..., self.dk:]

    def grad_chunk(self, n, dtype, device, zeros: bool = True):  # [n * R, g * Hkv, Dk + Dv], zeros or unset
        return (torch.zeros if zeros else torch.empty)(n * self.R, self.g * self.hkv, self.dk + self.dv, dtype=dtype,
                                                       device=device)

    @staticmethod
    def fused_grad(gk, gv):  # [n * R, g * Hkv, Dk] and [.., Dv] -> [n * R, g * Hkv, Dk + Dv], k's dtype
        fused = kernels.kv_fused(gk, gv)  # te / flash-attn hand a chunk's gradient back in its own layout
        return fused if fused is not None else torch.cat([gk, gv.to(gk.dtype)], dim=-1)

    @staticmethod
    def gather_kv(chunk_k, chunk_v, index):  # a call's K and V rows: one gather where they are one chunk's
        fused = kernels.kv_fused(chunk_k, chunk_v) if isinstance(index, torch.Tensor) else None
        if fused is None:
            return _gather(chunk_k, index), _gather(chunk_v, index)
        rows = fused.index_select(0, index)  # [n, g * Hkv, 2 * D]: its halves are again one buffer's
        return rows[..., :chunk_k.shape[-1]], rows[..., chunk_k.shape[-1]:]

    def add_kv_rows(self, grad, index, gk, gv):  # grad [n * R, g * Hkv, Dk + Dv][index] += (gk, gv)
        fused = kernels.kv_fused(gk, gv)
        if fused is not None:
            _add_rows(grad, index, fused)
        else:
            _add_rows(grad[..., :self.dk], index, gk)
            _add_rows(grad[..., self.dk:], index, gv)


def _transport(kind: str, k, v, state, plan, stats, prefix: str, fuse_sends: bool = False):
    if state.loopback is not None:  # testing.loopback: one rank in one process, chunks handed over on its device
        return state.loopback.transport(kind, k, v, state, plan, stats, prefix)
    chunk_rows = plan.stream[kind].chunk_rows
    if kind == "ring":
        return RingTransport(k, v, state.rank, state.cp, chunk_rows, state.group, stats, prefix,
                             state.ring_gradients(plan.window))
    if state.kv_exchange == "hierarchical":
        return HierarchicalTransport(k, v, state.rank, state.cp, chunk_rows, state.group, stats, prefix,
                                     plan.exchange.counts, state.hierarchical_route_on(k.device, plan.window, True),
                                     whole=state.gathered_plan(plan.window) is not None)
    if state.needed_whole(plan.window):  # the band mode: piece g of every source at once, read by bands
        return WholeNeededTransport(k, v, state.rank, state.cp, state.group, stats, prefix,
                                    state.send_indices_on(k.device, plan.window), plan.exchange.counts,
                                    state.whole_delivery_on(k.device, plan.window), fuse_sends=fuse_sends)
    return NeededTransport(k, v, state.rank, state.cp, Pieces(rows=chunk_rows), state.group, stats, prefix,
                           state.send_indices_on(k.device, plan.window), plan.exchange.counts, fuse_sends=fuse_sends)


# Forward posts the chunks of a2a / halo this many steps ahead of the one it attends. One ahead, the
# link idles from the moment a chunk lands until the step before it is attended, though the next
# transfer could be under way: while the own keys are attended, which take longer than the first
# chunk's transfer where a rank holds most of its keys. Two ahead, forward holds one chunk more (K/V of
# half a shard), under backward's peak (its gradients in flight). More ahead would issue more posts
# before the own keys' call, each delaying its launch. The ring forwards what it received the step
# before, and the hierarchical exchange moves everything in its first step: one ahead.
FORWARD_FETCHES_AHEAD = 2


def _forward_fetches_ahead(transport) -> int:
    return FORWARD_FETCHES_AHEAD if isinstance(transport, NeededTransport) else 1


def _sends_only(transport, step) -> bool:
    """Whether a2a / halo's fetch at ``step`` brings this rank nothing (it only sends): no call waits for it."""
    return isinstance(transport, NeededTransport) and transport.brings_nothing(step)


def _sink_logits(softmax_offset: Optional[torch.Tensor], groups: int, dtype) -> Optional[torch.Tensor]:
    # One logit per query head, [Hq]; the batch folded into heads repeats it per group.
    return None if softmax_offset is None else softmax_offset.detach().to(dtype).repeat(groups)


def _dropout_seed(backend: str, q: torch.Tensor, dropout_p: float) -> int:
    # Dense draws its masks from generators seeded here, from q's device's default generator (the
    # model-parallel RNG tracker's fork, under Megatron): recompute restores that generator, so it
    # draws the same seed; backward replays the masks from the seed. CUDA kernels keep their own state.
    if dropout_p == 0.0 or backend != "dense":
        return 0
    return int(torch.randint(1 << 62, (1,), device=q.device))


class _StreamedAttention(torch.autograd.Function):
    """Forward: attend chunk by chunk as they arrive, merge by lse. Backward: per chunk, send dK/dV home."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_offset, state, backend, scale, dropout_p, window):
        start = time.perf_counter()
        geo = _Geometry(q, k, v, state.rows)
        kind = chunk_kind(state.kv_exchange) if state.cp > 1 else "needed"
        plan = state.plan_for(window)
        steps = state.stream_plan(kind, window).steps
        calls = state.stream_on(kind, q.device, window)
        kernel = kernels.kernel_for(backend)
        stats = state.comm_stats
        for key in [key for key in stats if not key.startswith("backward_")]:
            del stats[key]  # this call's figures only (a model's layers share the state)
        for key in ("bytes_sent", "bytes_received", "wait_seconds", "compute_seconds"):
            stats[key] = 0
        stats["window"] = window  # report() gives this call's positions
        seed = _dropout_seed(backend, q, dropout_p)
        acc_dtype = kernels.lse_dtype(q.dtype)
        merges = state.merges_on(kind, q.device, window, sink=softmax_offset is not None)
        # backward's order, planned here: with the step's first call, not inside a later layer's backward
        state.backward_own_last(kind, q.device, window, sink=softmax_offset is not None)
        result = Result(merges, geo.g * geo.hq, geo.dv, q.dtype, acc_dtype, q.device, with_lse=True)
        acc = Accumulator(merges.merged_count, geo.g * geo.hq, geo.dv, acc_dtype, q.device, zeros=merges.needs_zeros)
        q_flat = geo.q_flat(q)
        aux: List = []
        failed = []

        def attend(step_calls, step_merges, chunk_k, chunk_v):
            t0 = time.perf_counter()
            for call, share in zip(step_calls, step_merges):
                if failed:  # zeros from here on; the transfers still run
                    aux.append(None)
                    continue
                qp = _gather(q_flat, call.q_index)
                kp, vp = geo.gather_kv(chunk_k, chunk_v, call.k_index)
                try:
                    o, lse, a = kernel.forward(qp, kp, vp, call.seg, scale, dropout_p, seed + len(aux))
                except Exception as exc:  # noqa: BLE001 - recorded, raised on every rank later
                    record_kernel_failure(state, backend, "forward", exc)
                    failed.append(True)
                    aux.append(None)
                    continue
                aux.append(a)
                result.take_output(call.q_index, share, o, lse, acc)
                del qp, kp, vp, o, lse  # before the next call allocates its own
            stats["compute_seconds"] += time.perf_counter() - t0

        save = state.kv_backward == "save"
        saved: List[torch.Tensor] = []  # save mode: the received chunks that have calls
        saved_at: List[int] = []  # per remote step, its index in ``saved`` (-1: not kept)
        transport = _transport(kind, k, v, state, plan, stats, "", fuse_sends=True) if state.cp > 1 else None
        ahead = _forward_fetches_ahead(transport)
        # the transfers posted and not yet waited for, in step order; ``posted``: the next step to post
        pending = deque(transport.start((step.round, step.piece)) for step in steps[1:1 + ahead])
        posted = 1 + len(pending)
        attend(calls[0], merges.calls[0], geo.kv_flat(k), geo.kv_flat(v))
        for s in range(1, len(steps)):
            chunk = pending.popleft().wait()
            transport.received(chunk)
            if posted < len(steps):  # one landed, one more posted: ``ahead`` in flight
                pending.append(transport.start((steps[posted].round, steps[posted].piece)))
                posted += 1
            if chunk is not None:
                attend(calls[s], merges.calls[s], *geo.split(chunk))
            keep = save and chunk is not None and bool(calls[s])
            saved_at.append(len(saved) if keep else -1)
            if keep:
                saved.append(chunk)
            del chunk  # refetch: gone before the next one lands (the ring's transport keeps it to forward)
        sink = _sink_logits(softmax_offset, geo.g, acc_dtype)
        if sink is not None:
            # An attention sink: one more logit in every row's denominator, with no value (every row is
            # merged then). The merged lse makes it a rescale; the kernels' backward sees the final lse.
            lse_total = torch.logaddexp(acc.lse, sink)
            acc.out.mul_(torch.exp(acc.lse - lse_total).unsqueeze(-1))
            acc.lse = lse_total
        out, lse = result.finish(acc.out, acc.lse)
        if failed:
            out = torch.zeros_like(out)
        out = out.view(geo.L, geo.b, geo.hq, geo.dv)
        stats["forward_seconds"] = time.perf_counter() - start
        ctx.state, ctx.backend, ctx.scale, ctx.dropout_p = state, backend, scale, dropout_p
        ctx.kind, ctx.aux, ctx.failed, ctx.saved_at, ctx.window = kind, aux, bool(failed), saved_at, window
        ctx.has_sink = sink is not None
        ctx.sink_dtype = None if softmax_offset is None else softmax_offset.dtype
        ctx.save_for_backward(q, k, v, out, lse, *(() if sink is None else (sink,)), *saved)
        return out

    @staticmethod
    def backward(ctx, dout):
        start = time.perf_counter()
        q, k, v, out, lse, *saved = ctx.saved_tensors
        sink = saved.pop(0) if ctx.has_sink else None
        state, backend, scale, dropout_p = ctx.state, ctx.backend, ctx.scale, ctx.dropout_p
        geo = _Geometry(q, k, v, state.rows)
        plan = state.plan_for(ctx.window)
        steps = state.stream_plan(ctx.kind, ctx.window).steps
        calls = state.stream_on(ctx.kind, q.device, ctx.window)
        partitions = state.key_partitions_on(ctx.kind, ctx.window)
        kernel = kernels.kernel_for(backend)
        stats = state.comm_stats
        for key in [key for key in stats if key.startswith("backward_")]:
            del stats[key]
        for key in ("backward_bytes_sent", "backward_bytes_received", "backward_grad_bytes_sent",
                    "backward_grad_bytes_received", "backward_wait_seconds", "backward_compute_seconds"):
            stats[key] = 0
        acc_dtype = kernels.lse_dtype(q.dtype)
        q_flat, o_flat = geo.q_flat(q), geo.q_flat(out)
        do_flat = geo.q_flat(dout.contiguous())
        # dq has the forward's writers: a row one call attends takes that call's dq, a row two attend is their
        # sum in dq's dtype (one rounding), rows of three or more add up in float32 (the sink adds nothing to
        # dq: all rows are merged then, as in forward)
        # With the received K/V kept, the own keys may go last: the last gradient home travels meanwhile
        own_last = state.backward_own_last(ctx.kind, q.device, ctx.window, sink=ctx.has_sink)
        merges = state.merges_on(ctx.kind, q.device, ctx.window, sink=ctx.has_sink, ends="gradient",
                                 own_last=own_last)
        dq = Result(merges, q_flat.shape[1], q_flat.shape[2], q.dtype, acc_dtype, q.device, with_lse=False)
        dq_merged = (torch.zeros if merges.needs_zeros else torch.empty)(
            (merges.merged_count,) + tuple(q_flat.shape[1:]), dtype=acc_dtype, device=q.device)
        offsets = [0]  # where each step's calls begin in forward's aux (one entry per call, in stream order)
        for step_calls in calls:
            offsets.append(offsets[-1] + len(step_calls))
        failed = [ctx.failed]

        def shares(s):  # step s's dq shares: ``merges`` lists the steps in the order backward takes them
            return merges.calls[(s - 1) % len(steps) if own_last else s]

        def differentiate(s, chunk_k, chunk_v, n_rows, keys=None, into=None, tiled=False, places=None):
            """Step s's dq into ``dq``; the own keys' gradients into ``keys`` (``KeyGradients``, step 0),
            else returns the chunk's [n * R, g * Hkv, Dk + Dv] gradient (in ``into``, k's dtype, where the
            transport hands one over and ``tiled``: the calls read every row of the chunk once; its row
            ``places[i]`` takes the chunk's row i where the transport gives ``places``)."""
            t0 = time.perf_counter()
            step_calls, step_merges, aux = calls[s], shares(s), iter(ctx.aux[offsets[s]:offsets[s + 1]])
            # Calls that read every row of the chunk once write each row's gradient once: no float32 sum.
            # One call reading every row in order: its gradient is the chunk's, as sent
            tiled = tiled and keys is None
            whole = tiled and into is None and len(step_calls) == 1 and step_calls[0].k_index is None
            grad = None
            if keys is None and not whole:
                if not tiled:
                    grad = geo.grad_chunk(n_rows, acc_dtype, q.device)
                else:  # every row is written: nothing to zero
                    grad = into if into is not None else geo.grad_chunk(n_rows, k.dtype, q.device, zeros=False)
            key_shares = keys.plan.calls[0] if keys is not None else step_merges  # the own calls' key rows
            for call, share, key_share in zip(step_calls, step_merges, key_shares):
                a = next(aux)
                if failed[0]:
                    continue
                qi, ki = call.q_index, call.k_index
                try:
                    gq, gk, gv = kernel.backward(
                        _gather(do_flat, qi), _gather(q_flat, qi), *geo.gather_kv(chunk_k, chunk_v, ki),
                        _gather(o_flat, qi), _gather(lse, qi), a, call.seg, scale, dropout_p)
                except Exception as exc:  # noqa: BLE001
                    record_kernel_failure(state, backend, "backward", exc)
                    failed[0] = True
                    continue
                dq.take(qi, share, gq, dq_merged)
                if keys is not None:
                    keys.take(ki, key_share, gk, gv)
                elif whole:
                    grad = geo.fused_grad(gk, gv)
                elif tiled:
                    _set_rows(grad, ki if into is None else _rows_of(places, ki), geo.fused_grad(gk, gv))
                else:
                    geo.add_kv_rows(grad, ki, gk, gv)
                del gq, gk, gv
            if failed[0] and tiled and grad is not None:
                grad.zero_()  # rows a failed call left unwritten: zeros go home, as on every failure
            stats["backward_compute_seconds"] += time.perf_counter() - t0
            return grad

        refetch = state.kv_backward != "save"
        transport = pending = None
        if len(steps) > 1:  # the first remote chunk moves while the local keys are differentiated
            transport = _transport(ctx.kind, k, v, state, plan, stats, "backward_")
            pending = transport.start((steps[1].round, steps[1].piece)) if refetch else None
        key_plan, key_slot, key_returns = state.key_merges_on(ctx.kind, q.device, ctx.window)
        dkv = KeyGradients(key_plan, geo.g * geo.hkv, geo.dk, geo.dv, k.dtype, acc_dtype, q.device, key_slot, geo.R,
                           key_returns)
        if not own_last:
            differentiate(0, geo.kv_flat(k), geo.kv_flat(v), geo.L, keys=dkv)
        if len(steps) > 1:
            in_flight = None  # the last gradient sent home, not yet waited for
            held = []  # own_last: what comes back is added once the own calls wrote dK / dV
            like = torch.empty((0, geo.b, geo.hkv * (geo.dk + geo.dv)), dtype=k.dtype, device=k.device)
            sent_only = []  # refetches that bring this rank nothing: waited for with the next that does
            for s in range(1, len(steps)):
                step = steps[s]
                if refetch:
                    if _sends_only(transport, (step.round, step.piece)):
                        sent_only.append(pending)
                        chunk = None
                    else:
                        chunk = pending.wait()
                        for transfer in sent_only:
                            transfer.wait()
                        sent_only = []
                    transport.received(chunk)
                    pending = (transport.start((steps[s + 1].round, steps[s + 1].piece))
                               if s + 1 < len(steps) else None)
                else:
                    index = ctx.saved_at[s - 1]
                    chunk = saved[index] if index >= 0 else None
                grad_chunk = None  # no call here: the transport sends zeros only where the home expects them
                if calls[s]:
                    # only calls that write every row of the chunk may fill the transport's own (unset) rows
                    into = transport.gradient_buffer((step.round, step.piece), chunk) if partitions[s] else None
                    grad_chunk = differentiate(s, *geo.split(chunk), chunk.shape[0],
                                               into=None if into is None else into.view(
                                                   chunk.shape[0] * geo.R, geo.g * geo.hkv, geo.dk + geo.dv),
                                               tiled=partitions[s],
                                               places=transport.gradient_places((step.round, step.piece)))
                    if grad_chunk is None:  # the kernel failed: zeros go home, as every transfer still runs
                        grad_chunk = geo.grad_chunk(chunk.shape[0], k.dtype, q.device)
                    grad_chunk = grad_chunk.view(chunk.shape[0], geo.b, -1).to(k.dtype)
                # Two gradient transfers in flight: this step's goes home before the last one's is waited
                # for, so a step that attends nothing here (it only gets our rows' gradients back) does not
                # hold the next transfer behind that landing
                sent = transport.send_gradient((step.round, step.piece), grad_chunk, like)
                if in_flight is not None:
                    if own_last:
                        held.append(in_flight)
                    else:
                        transport.settle(in_flight, dkv)
                in_flight = sent
                del chunk, grad_chunk
            if own_last:
                differentiate(0, geo.kv_flat(k), geo.kv_flat(v), geo.L, keys=dkv)
                for handle in held:
                    transport.settle(handle, dkv)
            for transfer in sent_only:
                transfer.wait()
            if in_flight is not None:
                transport.settle(in_flight, dkv)
            transport.finish(dkv)
        stats["backward_seconds"] = time.perf_counter() - start
        dk, dv = dkv.finish()
        if failed[0]:
            dk, dv = torch.zeros_like(dk), torch.zeros_like(dv)
        dk, dv = dk.view(geo.L, geo.b, geo.hkv, geo.dk), dv.view(geo.L, geo.b, geo.hkv, geo.dv)
        d_sink = None
        if sink is not None and ctx.needs_input_grad[3]:
            # d(loss)/d(sink) = -sum over rows of p_sink * (dout . out): the sink only rescales out.
            delta = (do_flat.to(acc_dtype) * o_flat.to(acc_dtype)).sum(-1)  # [rows, g * Hq]
            d_sink = -(torch.exp(sink - lse) * delta).sum(0).view(geo.g, geo.hq).sum(0).to(ctx.sink_dtype)
        dq, _ = dq.finish(dq_merged)
        if failed[0]:
            dq = torch.zeros_like(dq)
        return dq.view(q.shape), dk, dv, d_sink, None, None, None, None, None


def record_kernel_failure(state, backend: str, phase: str, exc: Exception) -> None:
    """Keep a failure for the next agreement point (end of step, or the next build)."""
    message = f"{backend} kernel failed in {phase} on CP rank {state.rank}: {type(exc).__name__}: {exc}"
    state.kernel_failures.append(message)
    PENDING_KERNEL_FAILURES.record(message)
    logger.error("blockdiag-cp: %s", message)


def _local_qkv_error(state, q, k, v, softmax_offset=None) -> str:
    """What is wrong with this rank's q/k/v (and sink logits) for this state ('' when nothing)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return (f"q, k, v must be [s, b, h, d] (Megatron sbhd); got {tuple(q.shape)}, {tuple(k.shape)}, "
                f"{tuple(v.shape)}")
    if q.shape[0] != state.local_len or k.shape[0] != state.local_len or v.shape[0] != state.local_len:
        return (f"q/k/v have {q.shape[0]}/{k.shape[0]}/{v.shape[0]} positions but the state expects "
                f"local_len={state.local_len} (sequence {state.seq_len}, padded {state.padded_len}, "
                f"cp={state.cp}); shard the batch with this state (state.shard / shard_batch)")
    if k.shape[:3] != v.shape[:3] or q.shape[1] != k.shape[1]:
        return (f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree in batch or heads "
                "(k and v must have the same [s, b, heads]; v's head dim may differ, as in MLA)")
    if q.shape[3] != k.shape[3]:
        return (f"q and k head dims differ: q {tuple(q.shape)}, k {tuple(k.shape)}; queries and keys share "
                "a head dim (MLA's k_channels), values may have their own (v_channels)")
    if q.shape[2] % k.shape[2] != 0:
        return (f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]}) for "
                "grouped-query attention")
    if state.rows not in (1, q.shape[1]):
        return (f"the state has doc ids for {state.rows} rows but the batch has {q.shape[1]}; pass "
                "doc_ids of shape [S] or [b, S]")
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})"
    if softmax_offset is not None and tuple(softmax_offset.shape) != (q.shape[2],):
        return (f"softmax_offset has shape {tuple(softmax_offset.shape)}; expected [{q.shape[2]}] (one sink "
                "logit per query head of this rank)")
    return ""


_SIGNATURE = ("q_len", "k_len", "batch", "q_heads", "kv_heads", "head_dim", "v_head_dim", "dtype", "window",
              "sink", "softmax_scale", "dropout_p")
_FLOAT_FACTS = ("softmax_scale", "dropout_p")  # ride as their float64 bits; shown as floats


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def agree_on_qkv(state, q, k, v, cp_group, window: Optional[int] = None, sink: bool = False,
                 scale: float = 1.0, dropout_p: float = 0.0, error: str = "", softmax_offset=None) -> None:
    """Raise on every CP rank when any rank's q/k/v or arguments are invalid or differ from its peers'.

    One all-reduce of ``AGREEMENT_WORDS`` int64 on q's device, the first time a state sees
    a signature (CP > 1): a model's layers share a few signatures, so a step pays it once
    or a few times, not per layer. Nothing at CP = 1. Every call agrees when
    ``MEGATRON_EXT_CP_CHECK_EVERY_CALL`` is set (a per-rank shape bug that appears only
    in a later layer then still raises instead of hanging). ``error``: what the caller
    already found wrong on this rank (a bad window_size); agreed like the rest, so this
    rank raises it with its peers, not before them.
    """
    if cp_group is not None and ps.group_size(cp_group) != state.cp:
        # A layer/state pairing error, the same on every rank of a real model: raised before agreeing,
        # since the caller's group is not the state's and the state's peers may never come; so a step
        # that exits with it has no peer to tell either.
        raise raised_on_every_rank(BlockDiagCPError(
            f"the CP group passed to attention has size {ps.group_size(cp_group)} but the state was "
            f"built for cp={state.cp}; build the state with cp_group=<this layer's group>"))
    error = error or _local_qkv_error(state, q, k, v, softmax_offset)
    if state.cp == 1:
        if error:
            raise BlockDiagCPError(error)
        return
    signature = (tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, k.dtype, v.dtype, q.device, window,
                 sink, float(scale), float(dropout_p))
    if not error and signature in state.agreed_signatures and not check_every_call():
        return
    values = (q.shape[0], k.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[-1],
              v.shape[-1] if v.dim() == 4 else -1, _DTYPE_CODES.get(q.dtype, 99),
              -1 if window is None else window, int(sink)) if q.dim() == 4 and k.dim() == 4 else (-1,) * 10
    facts = dict(zip(_SIGNATURE, values + (_float_bits(scale), _float_bits(dropout_p))))
    agreed = agree(facts, state.group, state.cp, device=q.device, kind=KIND_QKV,
                   invalid=INVALID_ARGUMENTS if error else 0, detail=error)
    differ = agreed.disagreeing(_SIGNATURE)
    if differ:
        shown = {name: (str if name not in _FLOAT_FACTS else lambda b: repr(_bits_float(b))) for name in differ}
        detail = ", ".join(f"{name} {shown[name](agreed.min(name))} vs {shown[name](agreed.max(name))} (this rank: "
                           f"{shown[name](facts[name])})" for name in differ)
        if "dtype" in differ:
            detail += " (dtype codes: " + ", ".join(f"{c}={str(t).replace('torch.', '')}"
                                                    for t, c in _DTYPE_CODES.items()) + ")"
        raise raised_on_every_rank(BlockDiagCPError(
            f"q/k/v differ across the CP ranks: {detail}; every CP rank must run the same model config "
            "(heads, head dim, dtype, micro batch, softmax scale, attention dropout)"))
    state.agreed_signatures.add(signature)


def window_from(window_size) -> Tuple[Optional[int], str]:
    """Megatron's window_size (left, right) -> (the left reach, None for unbounded; the error, '' when
    valid); causal only. The error is returned, not raised: the caller agrees on it first."""
    if window_size is None:
        return None, ""
    try:
        left, right = (int(x) for x in window_size)
    except (TypeError, ValueError):
        return None, f"window_size must be a (left, right) pair, got {window_size!r}"
    if right != 0 or left < -1:
        return None, (f"window_size={tuple(window_size)} is not a causal sliding window: block-diagonal CP "
                      "attention is causal within each document, so right must be 0 and left >= 0 (or -1: "
                      "no window)")
    return (None if left == -1 else left), ""


def blockdiag_cp_attention(q, k, v, softmax_scale=None, dropout_p=0.0, *, state=None, cp_group=None,
                           window_size=None, softmax_offset=None):
    """Per-document causal attention of this rank's queries over the CP group's keys.

    q: [local_len, b, Hq, Dqk]; k: [local_len, b, Hkv, Dqk]; v: [local_len, b, Hkv, Dv]
    -> [local_len, b, Hq, Dv] (Dv may differ from Dqk: MLA).
    ``state``: the microbatch's own state (pipeline schedules, Megatron's mask and
    THD paths pass it); None reads the state ``blockdiag_cp_step`` published.
    ``window_size``: Megatron's sliding window (left, 0): query p sees keys
    [max(document start, p - left), p]. ``softmax_offset``: [Hq] attention-sink
    logits (Megatron's ``softmax_offset``: zeros for "off-by-one", the learnable
    parameter for "learnable"), one more term in every row's softmax denominator.
    """
    count_cp_attn_fire()
    state = resolve_step_state() if state is None else state
    scale = kernels.default_softmax_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    # Checked here, raised only after the agreement: a rank alone with a bad value must not leave
    # its peers waiting in theirs.
    window, window_error = window_from(window_size)
    if state is None:
        group = ps.get_cp_group() if cp_group is None else cp_group
        cp = ps.group_size(group)
        if cp > 1:
            # Joins the agreement its peers are at, as invalid: they raise with it instead of waiting.
            agree({}, group, cp, device=q.device, kind=KIND_QKV, invalid=INVALID_NO_STATE, detail=(
                "pass Megatron's attention mask or THD packed_seq_params, or wrap forward and backward in "
                "`with blockdiag_cp_step(state):` (state from shard_batch or BlockDiagCPState.build); "
                "refusing to attend to local keys only"))
        if window_error:
            raise BlockDiagCPError(window_error)
        if window is None and softmax_offset is None:
            return _single_document_causal(q, k, v, scale, dropout_p)
        # The whole local sequence is one document; windows and sinks take the engine's path.
        from .step import BlockDiagCPState

        state = BlockDiagCPState.build(torch.ones(q.shape[0], dtype=torch.long), cp_group=group, device=q.device)
    agree_on_qkv(state, q, k, v, cp_group, window, softmax_offset is not None, scale=scale, dropout_p=dropout_p,
                 error=window_error, softmax_offset=softmax_offset)
    backend = call_backend(state, q, dropout_p, kv_heads=k.shape[2], window=window)
    window = state.clipping_window(window)  # None where it hides no key (after the backend heard of it)
    state.kv_row_bytes = k[0].numel() * k.element_size() + v[0].numel() * v.element_size()
    if state.kv_exchange == "ulysses" and state.cp > 1 and state.kv_exchange_requested == "planned" \
            and q.shape[2] % state.ulysses_size:
        state.fall_back_from_heads(q.shape[2])  # q's shape is agreed: every rank switches alike
    if state.kv_exchange == "ulysses" and state.cp > 1:
        return ulysses_attention(q, k, v, softmax_offset, state, backend, scale, dropout_p, window)
    if state.relaid is not None:
        return relaid_attention(q, k, v, softmax_offset, state, backend, scale, dropout_p, window)
    return streamed_attention(q, k, v, softmax_offset, state, backend, scale, dropout_p, window)


def streamed_attention(q, k, v, softmax_offset, state, backend: str, scale: float, dropout_p: float,
                       window: Optional[int]) -> torch.Tensor:
    """The streamed op on agreed inputs and a resolved backend (``blockdiag_cp_attention`` checks and
    resolves; the head-parallel path calls it on its head shards with a single-rank state)."""
    return _StreamedAttention.apply(q, k, v, softmax_offset, state, backend, scale, dropout_p, window)


def _single_document_causal(q, k, v, scale, dropout_p):
    # CP = 1 without a state: the whole local sequence is one causal document.
    qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, s, d]
    out = torch.nn.functional.scaled_dot_product_attention(
        qh, kh, vh, is_causal=True, scale=scale, dropout_p=dropout_p,
        enable_gqa=q.shape[2] != k.shape[2])
    return out.permute(2, 0, 1, 3)
