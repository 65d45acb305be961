"""blockdiag_cp_attention(): exchange K/V, gather the plan's segments, run the kernel, scatter back.

Per forward call, before any K/V moves, the CP ranks agree on the q/k/v shape
and dtype signature (one small all-reduce): a rank whose tensors are off raises
the same ``BlockDiagCPError`` as its peers instead of leaving them waiting in
the exchange. The kernel runs inside ``_GuardedKernel``: a failing kernel never
stops a rank half-way (its peers would wait in the backward collectives); the
failure is recorded and raised on every rank at the next agreement point.
"""

import logging
from typing import Optional

import torch

from .. import parallel_state as ps
from . import kernels
from .agreement import PENDING_KERNEL_FAILURES, BlockDiagCPError, agree
from .backend import call_backend
from .exchange import allgather_kv, needed_kv
from .resolve import resolve_step_state
from .state import _count_cp_attn_fire

logger = logging.getLogger("megatron_ext.blockdiag_cp")

_DTYPE_CODES = {torch.float64: 1, torch.float32: 2, torch.float16: 3, torch.bfloat16: 4}


def _pack_plain(t):
    # Detached: a saved output that kept its grad_fn would point back at the node saving it,
    # a reference cycle through C++ that no garbage collector frees (one layer leaked per call).
    return t.detach()


def _unpack_plain(t):
    return t


class _GuardedKernel(torch.autograd.Function):
    """Forward: run the kernel on a graph of its own, recording (not raising) a failure.
    Backward: differentiate that graph (again, when the caller retains the graph), likewise.

    The kernel's graph is saved with ``save_for_backward`` so autograd owns its
    lifetime: freed after a backward that does not retain the graph, kept for the
    next one when it does. It records its tensors under identity saved-tensor
    hooks, outside an enclosing checkpoint's: a non-reentrant checkpoint then
    recomputes this whole op once, instead of once more for the nested backward
    (a separate graph task), which would run the K/V collectives a third time.
    """

    @staticmethod
    def forward(ctx, q, k, v, fn, state, backend):
        ctx.state, ctx.backend = state, backend
        ctx.shapes = [(t.shape, t.dtype, t.device, t.requires_grad) for t in (q, k, v)]
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v)]
        try:
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_pack_plain, _unpack_plain):
                out = fn(*inputs)
        except Exception as exc:  # noqa: BLE001 - recorded, then raised on every rank
            record_kernel_failure(state, backend, "forward", exc)
            ctx.failed = True
            return q.new_zeros(q.shape)
        ctx.failed = False
        ctx.save_for_backward(out, *inputs)
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        # Zero (not None) gradients on failure keep the exchange's backward collectives running.
        zeros = [torch.zeros(s, dtype=dt, device=dev) if rg else None for s, dt, dev, rg in ctx.shapes]
        if ctx.failed:
            return tuple(zeros) + (None, None, None)
        out, *inputs = ctx.saved_tensors
        wanted = [t for t in inputs if t.requires_grad]
        if not out.requires_grad or not wanted:  # no segments on this rank (all padding)
            return tuple(zeros) + (None, None, None)
        try:
            grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True, retain_graph=True))
            result = [next(grads) if t.requires_grad else None for t in inputs]
        except Exception as exc:  # noqa: BLE001
            record_kernel_failure(ctx.state, ctx.backend, "backward", exc)
            return tuple(zeros) + (None, None, None)
        result = [z if r is None and z is not None else r for r, z in zip(result, zeros)]
        return tuple(result) + (None, None, None)


def record_kernel_failure(state, backend: str, phase: str, exc: Exception) -> None:
    """Keep a failure for the next agreement point (end of step, or the next build)."""
    message = f"{backend} kernel failed in {phase} on CP rank {state.rank}: {type(exc).__name__}: {exc}"
    state.kernel_failures.append(message)
    PENDING_KERNEL_FAILURES.record(message)
    logger.error("blockdiag-cp: %s", message)


def _local_qkv_error(state, q, k, v) -> str:
    """What is wrong with this rank's q/k/v for this state ('' when nothing)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return (f"q, k, v must be [s, b, h, d] (Megatron sbhd); got {tuple(q.shape)}, {tuple(k.shape)}, "
                f"{tuple(v.shape)}")
    if q.shape[0] != state.local_len or k.shape[0] != state.local_len or v.shape[0] != state.local_len:
        return (f"q/k/v have {q.shape[0]}/{k.shape[0]}/{v.shape[0]} positions but the state expects "
                f"local_len={state.local_len} (sequence {state.seq_len}, padded {state.padded_len}, "
                f"cp={state.cp}); shard the batch with this state (state.shard / shard_batch)")
    if k.shape != v.shape or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        return (f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree "
                "(batch, head dim, or k vs v)")
    if q.shape[2] % k.shape[2] != 0:
        return (f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]}) for "
                "grouped-query attention")
    if state.rows not in (1, q.shape[1]):
        return (f"the state has doc ids for {state.rows} rows but the batch has {q.shape[1]}; pass "
                "doc_ids of shape [S] or [b, S]")
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})"
    return ""


_SIGNATURE = ("q_len", "k_len", "batch", "q_heads", "kv_heads", "head_dim", "dtype")


def agree_on_qkv(state, q, k, v, cp_group) -> None:
    """Raise on every CP rank when any rank's q/k/v is invalid or differs from its peers'.

    One all-reduce of 16 int64 per forward call (CP > 1); nothing at CP = 1.
    """
    if cp_group is not None and ps.group_size(cp_group) != state.cp:
        # A layer/state pairing error, the same on every rank of a real model: raised before agreeing,
        # since the caller's group is not the state's and the state's peers may never come.
        raise BlockDiagCPError(
            f"the CP group passed to attention has size {ps.group_size(cp_group)} but the state was "
            f"built for cp={state.cp}; build the state with cp_group=<this layer's group>")
    error = _local_qkv_error(state, q, k, v)
    if state.cp == 1:
        if error:
            raise BlockDiagCPError(error)
        return
    values = (q.shape[0], k.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[-1],
              _DTYPE_CODES.get(q.dtype, 99)) if q.dim() == 4 and k.dim() == 4 else (-1,) * 7
    facts = dict(zip(_SIGNATURE, values), invalid=1 if error else 0)
    agreed = agree(facts, state.group, state.cp)
    if agreed.max("invalid"):
        raise BlockDiagCPError(error or "invalid q/k/v on another CP rank (see its error); every CP "
                                        "rank raises it")
    differ = agreed.disagreeing(_SIGNATURE)
    if differ:
        detail = ", ".join(f"{name} {agreed.min(name)} vs {agreed.max(name)}" for name in differ)
        if "dtype" in differ:
            detail += " (dtype codes: " + ", ".join(f"{c}={str(t).replace('torch.', '')}"
                                                    for t, c in _DTYPE_CODES.items()) + ")"
        raise BlockDiagCPError(f"q/k/v differ across the CP ranks: {detail}; every CP rank must run "
                               f"the same model config (heads, head dim, dtype, micro batch)")


def blockdiag_cp_attention(q, k, v, softmax_scale=None, dropout_p=0.0, *, state=None, cp_group=None):
    """Per-document causal attention of this rank's queries over the CP group's keys.

    q: [local_len, b, Hq, D]; k, v: [local_len, b, Hkv, D] -> [local_len, b, Hq, D].
    ``state``: the microbatch's own state (pipeline schedules, Megatron's mask and
    THD paths pass it); None reads the state ``blockdiag_cp_step`` published.
    """
    _count_cp_attn_fire()
    state = resolve_step_state() if state is None else state
    scale = kernels.default_softmax_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    if state is None:
        group = ps.get_cp_group() if cp_group is None else cp_group
        if ps.group_size(group) > 1:
            raise BlockDiagCPError(
                "block-diagonal CP attention ran with CP > 1 but no step state: pass Megatron's "
                "attention mask or THD packed_seq_params, or wrap forward and backward in "
                "`with blockdiag_cp_step(state):` (state from shard_batch or BlockDiagCPState.build); "
                "refusing to attend to local keys only")
        return _single_document_causal(q, k, v, scale, dropout_p)
    agree_on_qkv(state, q, k, v, cp_group)
    backend = call_backend(state, q, dropout_p)

    L, b, hq, d = q.shape
    hkv = k.shape[2]
    R = state.rows
    # Rows with their own doc ids flatten into tokens; shared ids fold the batch into heads.
    g = b // R
    q_flat = q.reshape(L * R, g * hq, d)
    state.kv_row_bytes = 2 * k[0].numel() * k.element_size()
    if state.cp == 1:
        # Nothing to exchange: gather K and V directly, skipping the fused copy.
        q_index, k_index, seg = state.segments_on("sparse", q.device)
        k_packed = _gather(k.reshape(L * R, g * hkv, d), k_index)
        v_packed = _gather(v.reshape(L * R, g * hkv, d), k_index)
    else:
        kv = torch.cat([k, v], dim=-1).view(L, b, -1)  # [L, b, Hkv * 2D]: one collective for both
        if state.kv_exchange == "allgather":
            kind = "allgather"
            buf = allgather_kv(kv, state.group, state.comm_stats)
        else:
            kind = "sparse"
            buf = needed_kv(kv, state.send_index_on(kv.device), state.plan.exchange.counts, state.rank,
                            state.group, use_p2p=state.kv_exchange == "halo", stats=state.comm_stats)
        q_index, k_index, seg = state.segments_on(kind, q.device)
        buf_flat = buf.reshape(buf.shape[0] * R, g * hkv, 2 * d)
        k_packed, v_packed = _gather(buf_flat, k_index).split(d, dim=-1)  # [Nk, g*Hkv, D]
    q_packed = _gather(q_flat, q_index)  # [Nq, g*Hq, D]

    fn = kernels.kernel_for(backend)

    def run(qp, kp, vp):
        if qp.shape[0] == 0:
            # Every query of this rank is padding: no kernel call (varlen kernels are not promised to
            # take zero segments); _GuardedKernel still returns zero grads so backward collectives run.
            return qp.new_zeros(qp.shape)
        return fn(qp, kp.contiguous(), vp.contiguous(), seg, scale, dropout_p)

    out_packed = _GuardedKernel.apply(q_packed, k_packed, v_packed, run, state, backend)
    out_packed = out_packed.to(q.dtype)
    out = out_packed if q_index is None else q_flat.new_zeros(q_flat.shape).index_copy(0, q_index, out_packed)
    return out.view(L, b, hq, d)


def _gather(x: torch.Tensor, index: Optional[torch.Tensor]) -> torch.Tensor:
    return x if index is None else x.index_select(0, index)


def _single_document_causal(q, k, v, scale, dropout_p):
    # CP = 1 without a state: the whole local sequence is one causal document.
    qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, s, d]
    out = torch.nn.functional.scaled_dot_product_attention(
        qh, kh, vh, is_causal=True, scale=scale, dropout_p=dropout_p,
        enable_gqa=q.shape[2] != k.shape[2])
    return out.permute(2, 0, 1, 3)
