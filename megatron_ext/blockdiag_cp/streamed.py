"""The streamed op: this rank's queries over the needed K/V, chunk by chunk, merged by log-sum-exp.

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

It runs on inputs ``attention_op.blockdiag_cp_attention`` has checked and agreed on,
with a resolved backend; the head-parallel (``ulysses``) and re-laid (``relayout``)
paths run it too, on their own shards. A kernel that fails never stops a rank
half-way (its peers would wait in the transfers): the failure is recorded, the call
contributes zeros, every transfer still runs, and every rank raises it at the next
agreement point.
"""

import logging
import time
from collections import deque
from typing import List, Optional

import torch

from . import kernels
from .agreement import PENDING_KERNEL_FAILURES
from .chunks import chunk_kind
from .exchange import HierarchicalTransport, NeededTransport, Pieces, RingTransport, WholeNeededTransport
from .merge import (Accumulator, KeyGradients, Result, add_rows as _add_rows, gather as _gather, rows_of as _rows_of,
                    set_rows as _set_rows)

logger = logging.getLogger("megatron_ext.blockdiag_cp")


class _Geometry:
    """How one call's tensors flatten for the kernels.

    Rows with their own doc ids flatten into tokens (``s * R + row``); shared ids
    fold the batch into heads. A remote chunk is K and V fused, [n, b, Hkv * (Dk + Dv)], or planar,
    [2, n, b, Hkv * D] (K then V: a whole shard's piece as it travels, ``exchange.NeededTransport``).
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

    def split(self, chunk):  # [n, b, F] or [2, n, b, F / 2] -> k [n * R, g * Hkv, Dk], v [.., Dv] (views)
        if chunk.dim() == 4:
            flat = chunk.view(2, chunk.shape[1] * self.R, self.g * self.hkv, self.dk)
            return flat[0], flat[1]
        flat = chunk.view(chunk.shape[0] * self.R, self.g * self.hkv, self.dk + self.dv)
        return flat[..., :self.dk], flat[..., self.dk:]

    @staticmethod
    def rows(chunk) -> int:  # positions of a fused or planar chunk
        return chunk.shape[-3]

    def grad_chunk(self, n, dtype, device, zeros: bool = True, planar: bool = False):
        """[n * R, g * Hkv, Dk + Dv], zeros or unset; ``planar``: [2, n * R, g * Hkv, D] (dK rows, then dV's)."""
        shape = (2, n * self.R, self.g * self.hkv, self.dk) if planar else (n * self.R, self.g * self.hkv,
                                                                           self.dk + self.dv)
        return (torch.zeros if zeros else torch.empty)(shape, dtype=dtype, device=device)

    def on_wire(self, grad, n, dtype):
        """A chunk's gradient as it goes home: [n, b, F] in ``dtype``; a planar one (a [2, ...] buffer or the
        kernel's (dK, dV)) as its two halves, [n, b, F / 2] each."""
        if isinstance(grad, tuple) or grad.dim() == 4:
            return tuple(half.reshape(n, self.b, -1).to(dtype) for half in grad)
        return grad.view(n, self.b, -1).to(dtype)

    @staticmethod
    def fused_grad(gk, gv):  # [n * R, g * Hkv, Dk] and [.., Dv] -> [n * R, g * Hkv, Dk + Dv], k's dtype
        fused = kernels.kv_fused(gk, gv)  # te / flash-attn hand a chunk's gradient back in its own layout
        return fused if fused is not None else torch.cat([gk, gv.to(gk.dtype)], dim=-1)

    @staticmethod
    def gather_kv(chunk_k, chunk_v, index):  # a call's K and V rows: one gather where they are one chunk's
        if not isinstance(index, torch.Tensor):
            return _gather(chunk_k, index), _gather(chunk_v, index)
        planar = kernels.kv_planar(chunk_k, chunk_v)
        if planar is not None:
            rows = planar.index_select(1, index)  # [2, n, g * Hkv, D]: again K then V, each contiguous
            return rows[0], rows[1]
        fused = kernels.kv_fused(chunk_k, chunk_v)
        if fused is None:
            return _gather(chunk_k, index), _gather(chunk_v, index)
        rows = fused.index_select(0, index)  # [n, g * Hkv, 2 * D]: its halves are again one buffer's
        return rows[..., :chunk_k.shape[-1]], rows[..., chunk_k.shape[-1]:]

    def add_kv_rows(self, grad, index, gk, gv):  # grad [n * R, g * Hkv, Dk + Dv][index] += (gk, gv)
        fused = kernels.kv_fused(gk, gv)
        if grad.dim() == 4:  # planar
            _add_rows(grad[0], index, gk)
            _add_rows(grad[1], index, gv)
        elif fused is not None:
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
                             state.ring_gradients(plan.window), planar=True, reach=state.ring_reach(plan.window))
    if state.kv_exchange == "hierarchical":
        return HierarchicalTransport(k, v, state.rank, state.cp, chunk_rows, state.group, stats, prefix,
                                     plan.exchange.counts, state.hierarchical_route_on(k.device, plan.window, True),
                                     whole=state.gathered_plan(plan.window) is not None)
    if state.needed_whole(plan.window):  # the band mode: piece g of every source at once, read by bands
        return WholeNeededTransport(k, v, state.rank, state.cp, state.group, stats, prefix,
                                    state.send_indices_on(k.device, plan.window), plan.exchange.counts,
                                    state.whole_delivery_on(k.device, plan.window), fuse_sends=fuse_sends)
    return NeededTransport(k, v, state.rank, state.cp, Pieces(rows=chunk_rows), state.group, stats, prefix,
                           state.send_indices_on(k.device, plan.window), plan.exchange.counts, fuse_sends=fuse_sends,
                           runs=state.pair_runs(plan.window))


# Forward posts the chunks this many steps ahead of the one it attends. One ahead, the link idles from
# the moment a chunk lands until the step before it is attended, though the next transfer could be
# under way: while the own keys are attended, which take longer than the first chunk's transfer where a
# rank holds most of its keys. Two ahead, forward holds one chunk more (K/V of half a shard), under
# backward's peak (its gradients in flight). More ahead would issue more posts before the own keys'
# call, each delaying its launch. The ring posts a step only once what it forwards has landed
# (``RingTransport.can_start``): at cp 2 both pieces of its own go before the own keys' call, at cp > 2
# a piece's first hop goes while the last one's final hop moves. The hierarchical exchange moves
# everything in its first step: one ahead.
FORWARD_FETCHES_AHEAD = 2


def _forward_fetches_ahead(transport) -> int:
    return 1 if isinstance(transport, HierarchicalTransport) else FORWARD_FETCHES_AHEAD


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


class HeldCall:
    """What one streamed call's forward keeps for its backward, where a caller runs the call inside its
    own autograd Function (``head_groups``): the attributes ``streamed_forward`` sets, and its saved
    tensors, which the caller passes through its own ``save_for_backward``."""

    def __init__(self, sink_needs_grad: bool):
        self.needs_input_grad = (True, True, True, sink_needs_grad)
        self.saved_tensors: tuple = ()

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors


def streamed_forward(ctx, q, k, v, softmax_offset, state, backend, scale, dropout_p, window):
    """The streamed op's forward on ``ctx`` (an autograd context or a ``HeldCall``): [L, b, Hq, Dv]."""
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
    pending, posted = deque(), 1

    def post_ahead():  # in step order, up to ``ahead`` in flight, while the next one can go
        nonlocal posted
        while (posted < len(steps) and len(pending) < ahead
               and transport.can_start((steps[posted].round, steps[posted].piece))):
            pending.append(transport.start((steps[posted].round, steps[posted].piece)))
            posted += 1

    if transport is not None:
        post_ahead()
    attend(calls[0], merges.calls[0], geo.kv_flat(k), geo.kv_flat(v))
    for s in range(1, len(steps)):
        chunk = pending.popleft().wait()
        transport.received(chunk)
        post_ahead()  # one landed: one more (the ring: one it forwards) goes
        if chunk is not None:
            attend(calls[s], merges.calls[s], *geo.split(chunk))
        elif calls[s]:  # the tables that decide what moves disagree with this rank's calls
            raise RuntimeError(f"blockdiag-cp: rank {state.rank} has calls on the keys of step "
                               f"{(steps[s].round, steps[s].piece)}, which no transfer brought")
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


def streamed_backward(ctx, dout):
    """The streamed op's backward on the ``ctx`` its forward filled: (dq, dk, dv, d_sink, None * 5)."""
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

    def differentiate(s, chunk_k, chunk_v, n_rows, keys=None, into=None, tiled=False, places=None,
                      planar=False):
        """Step s's dq into ``dq``; the own keys' gradients into ``keys`` (``KeyGradients``, step 0),
        else returns the chunk's [n * R, g * Hkv, Dk + Dv] gradient (in ``into``, k's dtype, where the
        transport hands one over and ``tiled``: the calls read every row of the chunk once; its row
        ``places[i]`` takes the chunk's row i where the transport gives ``places``); a ``planar``
        chunk's as [2, n * R, g * Hkv, D], or as the kernel's (dK, dV) where one call reads it whole."""
        t0 = time.perf_counter()
        step_calls, step_merges, aux = calls[s], shares(s), iter(ctx.aux[offsets[s]:offsets[s + 1]])
        # Calls that read every row of the chunk once write each row's gradient once: no float32 sum.
        # One call reading every row in order: its gradient is the chunk's, as sent
        tiled = tiled and keys is None
        whole = tiled and into is None and len(step_calls) == 1 and step_calls[0].k_index is None
        grad = None
        if keys is None and not whole:
            if not tiled:
                grad = geo.grad_chunk(n_rows, acc_dtype, q.device, planar=planar)
            else:  # every row is written: nothing to zero
                grad = into if into is not None else geo.grad_chunk(n_rows, k.dtype, q.device, zeros=False,
                                                                    planar=planar)
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
                grad = (gk, gv) if planar else geo.fused_grad(gk, gv)
            elif tiled and planar:
                _set_rows(grad[0], ki, gk)
                _set_rows(grad[1], ki, gv)
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
    key_plan, key_slot, key_returns = state.key_merges_on(ctx.kind, q.device, ctx.window,
                                                          narrow=k.dtype.itemsize < acc_dtype.itemsize)
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
                n_rows, planar = geo.rows(chunk), chunk.dim() == 4
                grad_chunk = differentiate(s, *geo.split(chunk), n_rows,
                                           into=None if into is None else into.view(
                                               n_rows * geo.R, geo.g * geo.hkv, geo.dk + geo.dv),
                                           tiled=partitions[s],
                                           places=transport.gradient_places((step.round, step.piece)),
                                           planar=planar)
                if grad_chunk is None:  # the kernel failed: zeros go home, as every transfer still runs
                    grad_chunk = geo.grad_chunk(n_rows, k.dtype, q.device, planar=planar)
                grad_chunk = geo.on_wire(grad_chunk, n_rows, k.dtype)
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


class _StreamedAttention(torch.autograd.Function):
    """Forward: attend chunk by chunk as they arrive, merge by lse. Backward: per chunk, send dK/dV home."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_offset, state, backend, scale, dropout_p, window):
        return streamed_forward(ctx, q, k, v, softmax_offset, state, backend, scale, dropout_p, window)

    @staticmethod
    def backward(ctx, dout):
        return streamed_backward(ctx, dout)


def record_kernel_failure(state, backend: str, phase: str, exc: Exception) -> None:
    """Keep a failure for the next agreement point (end of step, or the next build)."""
    message = f"{backend} kernel failed in {phase} on CP rank {state.rank}: {type(exc).__name__}: {exc}"
    state.kernel_failures.append(message)
    PENDING_KERNEL_FAILURES.record(message)
    logger.error("blockdiag-cp: %s", message)


def streamed_attention(q, k, v, softmax_offset, state, backend: str, scale: float, dropout_p: float,
                       window: Optional[int]) -> torch.Tensor:
    """The streamed op on agreed inputs and a resolved backend (``blockdiag_cp_attention`` checks and
    resolves; the head-parallel path calls it on its head shards with a single-rank state)."""
    return _StreamedAttention.apply(q, k, v, softmax_offset, state, backend, scale, dropout_p, window)
