"""blockdiag_cp_attention(): the public entry point. Check, agree, and hand the call to its path.

Every call resolves its step state (``resolve``), checks this rank's q/k/v and
arguments, and picks the path the state resolved: the streamed op (``streamed``:
the needed K/V chunk by chunk, merged by log-sum-exp), head-parallel CP
(``ulysses``), or the re-laid step (``relayout``: rows move to the balanced layout
and back around the streamed op).

The first call of a step's state, and every new q/k/v shape after it, runs one
small agreement all-reduce of the q/k/v signature (with the softmax scale, the
dropout, the window and the sink), so a rank whose tensors or arguments are off
raises with its peers instead of leaving them waiting in the exchange; the
calls after that run no collective besides the K/V transfers and no host sync
(``MEGATRON_EXT_CP_CHECK_EVERY_CALL=1`` agrees on every call, for debugging).
"""

import os
import struct
from typing import Optional, Tuple

import torch

from .. import parallel_state as ps
from . import kernels
from .agreement import (
    INVALID_ARGUMENTS,
    INVALID_NO_STATE,
    KIND_QKV,
    BlockDiagCPError,
    agree,
    raised_on_every_rank,
)
from .backend import call_backend
from .relayout import relaid_attention
from .resolve import resolve_step_state
from .state import count_cp_attn_fire
from .step import BlockDiagCPState
from .streamed import streamed_attention
from .ulysses import ulysses_attention

_DTYPE_CODES = {torch.float64: 1, torch.float32: 2, torch.float16: 3, torch.bfloat16: 4}
CHECK_EVERY_CALL_ENV = "MEGATRON_EXT_CP_CHECK_EVERY_CALL"


def check_every_call() -> bool:
    return os.environ.get(CHECK_EVERY_CALL_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


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


def _single_document_causal(q, k, v, scale, dropout_p):
    # CP = 1 without a state: the whole local sequence is one causal document.
    qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, s, d]
    out = torch.nn.functional.scaled_dot_product_attention(
        qh, kh, vh, is_causal=True, scale=scale, dropout_p=dropout_p,
        enable_gqa=q.shape[2] != k.shape[2])
    return out.permute(2, 0, 1, 3)
