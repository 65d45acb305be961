"""Document ids from EOD tokens or cu_seqlens, shard_batch(), and the step context."""

import contextlib
import threading
from typing import Dict, Optional, Tuple

import torch

from .agreement import BlockDiagCPError, agree_on_kernel_failures, agree_on_step_abort
from .state import _CP_BLOCKDIAG_STATE
from .step import BlockDiagCPState

_SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "doc_ids")


def doc_ids_from_eod(tokens: torch.Tensor, eod_token: int) -> torch.Tensor:
    """[.., S] 1-based document ids; the EOD belongs to the document it ends (Megatron's rule)."""
    is_eod = (tokens == eod_token).to(torch.int64)
    ended_before = torch.cumsum(is_eod, dim=-1) - is_eod  # EODs strictly before each position
    return ended_before + 1


def doc_ids_from_cu_seqlens(cu_seqlens, total_len: Optional[int] = None) -> torch.Tensor:
    """[S] 1-based document ids from cumulative lengths [0, l1, l1+l2, ...]; beyond the end is 0."""
    cu = torch.as_tensor(cu_seqlens, dtype=torch.int64).flatten().cpu()
    if cu.numel() < 1 or int(cu[0]) != 0 or bool((cu.diff() < 0).any()):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu.tolist()}")
    total = int(cu[-1]) if total_len is None else total_len
    if total < int(cu[-1]):
        raise ValueError(f"total_len {total} is shorter than cu_seqlens[-1] = {int(cu[-1])}")
    lengths = cu.diff()
    ids = torch.repeat_interleave(torch.arange(1, lengths.numel() + 1), lengths)
    return torch.cat([ids, torch.zeros(total - ids.numel(), dtype=torch.int64)])


def shard_batch(batch: Dict, cp_group=None, layout=None, eod_token=None, attn_backend=None,
                kv_exchange=None, strict=False, cost_model=None,
                prepared=None, kv_backward=None, windows=None, ulysses_size=None,
                relayout=None) -> Tuple[Dict, BlockDiagCPState]:
    """Pad and slice every sequence-aligned tensor of ``batch`` to this CP rank; build the state.

    batch: ``tokens`` [b, S] and optional ``labels``, ``loss_mask``, ``position_ids``,
    ``doc_ids`` ([S] or [b, S]). Doc ids come from ``doc_ids``, else from
    ``eod_token``, else one document per row. Position ids default to the global
    positions; padded positions get loss mask 0. ``cost_model``, ``prepared`` (a
    plan made ahead of time by ``prepare_plan``), ``kv_backward`` ("refetch" | "save" |
    "auto"), ``windows`` (the model's sliding windows, which ``balanced`` prices),
    ``ulysses_size`` (two-dimensional CP) and ``relayout`` ("balanced": attend there) go to
    ``BlockDiagCPState.build``.
    """
    if "tokens" not in batch:
        raise KeyError("shard_batch needs batch['tokens'] of shape [b, S]")
    tokens = batch["tokens"]
    if tokens.dim() != 2:
        raise ValueError(f"batch['tokens'] must be [b, S], got shape {tuple(tokens.shape)}")
    b, S = tokens.shape
    if batch.get("doc_ids") is not None:
        doc_ids = batch["doc_ids"]
        if isinstance(doc_ids, torch.Tensor) and doc_ids.shape[-1] != S:
            raise ValueError(f"batch['doc_ids'] has length {doc_ids.shape[-1]} but tokens have "
                             f"S={S}; pass one id per token ([S] or [b, S])")
    elif eod_token is not None:
        doc_ids = doc_ids_from_eod(tokens.cpu(), eod_token)
    else:
        doc_ids = torch.ones(S, dtype=torch.int64)
    state = BlockDiagCPState.build(doc_ids, cp_group=cp_group, layout=layout,
                                   attn_backend=attn_backend, kv_exchange=kv_exchange,
                                   strict=strict, device=tokens.device if tokens.is_cuda else None,
                                   cost_model=cost_model, prepared=prepared, kv_backward=kv_backward,
                                   windows=windows, ulysses_size=ulysses_size, relayout=relayout)
    out = dict(batch)
    out.pop("attention_mask", None)  # never materialized: the plan carries the documents
    if out.get("position_ids") is None:
        out["position_ids"] = torch.arange(S, device=tokens.device).unsqueeze(0).expand(b, S)
    if out.get("loss_mask") is None and state.padded_len != S:
        out["loss_mask"] = torch.ones(b, S, dtype=torch.float32, device=tokens.device)
    for key, value in list(out.items()):
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (b, S):
            out[key] = state.shard(value, seq_dim=1)
        elif key == "doc_ids" and isinstance(value, torch.Tensor) and value.dim() == 1:
            out[key] = state.shard(value, seq_dim=0)
    return out, state


@contextlib.contextmanager
def blockdiag_cp_step(state: BlockDiagCPState):
    """Publish ``state`` for every attention layer (and recompute thread) of one step.

    Forward and backward run inside (a backward that runs later, outside, is fine
    too when the model got ``packed_seq_params_for(state)``). On a clean exit the
    ranks agree on kernel failures (one tiny all-reduce) and raise together if any
    rank failed. A step that exits with an exception its peers did not raise with it
    (one rank's own error, in forward, in backward or between them) joins the
    agreement its peers are at as invalid, so every CP rank raises the same
    ``BlockDiagCPError``, this rank's chained to the exception. One step at a time
    per process: the published state is process-wide, so a step entered while
    another is open (nested, or from a second thread) is refused.
    """
    me = threading.get_ident()
    current = _CP_BLOCKDIAG_STATE.get()
    if current is not None:
        if getattr(current, "_published_by", None) not in (None, me):
            raise BlockDiagCPError(
                "blockdiag_cp_step entered from a second thread while another thread's step is open; the "
                "published step state is process-wide (autograd's recompute thread must read it), so "
                "block-diagonal CP runs one step at a time per process")
        raise BlockDiagCPError(
            "blockdiag_cp_step entered inside another step's context: the attention layers would read the "
            "inner state, the outer step's documents silently lost; close the open step first (one "
            "`with blockdiag_cp_step(state):` around each step's forward and backward)")
    previous_owner = getattr(state, "_published_by", None)
    state._published_by = me
    token = _CP_BLOCKDIAG_STATE.set(state)
    failure = None
    try:
        yield state
    except Exception as exc:  # noqa: BLE001 - told to the peers below, then raised
        failure = exc
    finally:
        _CP_BLOCKDIAG_STATE.reset(token)
        state._published_by = previous_owner
    if failure is not None:
        if state.cp == 1 or getattr(failure, "on_every_rank", False):
            raise failure  # no peers, or every peer raised it at the same agreement: nothing to tell
        agree_on_step_abort(state.group, state.cp, failure)
    agree_on_kernel_failures(state.group, state.cp)
