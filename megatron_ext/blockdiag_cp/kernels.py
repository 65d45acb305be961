"""Attention kernels over the plan's varlen segments: dense (torch SDPA), flash varlen, TE thd.

Every kernel has one contract, the flash varlen one:
    q [Nq, Hq, D], k/v [Nk, Hkv, D], cu_seqlens_q/k [n+1] int32 -> out [Nq, Hq, D]
segment i's queries attend its keys with bottom-right causal alignment (the last
query sees the last key), which is right for a document whose keys begin on an
earlier rank. Hq % Hkv == 0 (GQA).

``te`` and ``flash`` are imported lazily and are only ever "available" on CUDA
with fp16/bf16 inputs; each availability check returns (ok, reason) and never
raises.

The kernel table, the availability answers and the library lookups have test
hooks (the ``_*_OVERRIDES`` tables at the end). They are not part of the public
face: tests and benchmarks set them only through ``megatron_ext.testing``
(``override_kernel``, ``override_availability``, ``override_library``), which
restores them on exit.
"""

import importlib
import inspect
import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

# Largest bool mask (elements) the dense kernel builds for one query block.
_DENSE_MASK_BUDGET = 1 << 24


@dataclass(frozen=True)
class Segments:
    """Device-side view of KernelSegments for one call."""

    cu_seqlens_q: torch.Tensor  # int32 on the kernel's device
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    q_lens: Tuple[int, ...]  # host copies, so the dense loop needs no device sync
    k_lens: Tuple[int, ...]


# ---------------------------------------------------------------------------
# dense
# ---------------------------------------------------------------------------


def dense_varlen(q, k, v, seg: Segments, softmax_scale: float, dropout_p: float = 0.0):
    """One SDPA per segment; only an (nq x nk) block mask where keys start earlier."""
    outs = []
    gqa = q.shape[1] != k.shape[1]
    for qs, ks, vs in zip(q.split(seg.q_lens), k.split(seg.k_lens), v.split(seg.k_lens)):
        # [1, H, n, D]: SDPA's fused CPU kernel takes 4-D inputs only (3-D falls back to math)
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (qs, ks, vs))
        outs.append(_causal_bottom_right(qs, ks, vs, softmax_scale, dropout_p, gqa)[0].transpose(0, 1))
    if not outs:
        return q.new_zeros(q.shape)
    return torch.cat(outs, dim=0)


def _causal_bottom_right(q, k, v, scale, dropout_p, gqa):
    nq, nk = q.shape[-2], k.shape[-2]
    if nq == nk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              dropout_p=dropout_p, enable_gqa=gqa)
    # Keys begin before the first query: query j sees keys [0, nk - nq + j]. Block the
    # queries so no mask exceeds the budget (never O(local_len x S) at once).
    block = max(1, min(nq, _DENSE_MASK_BUDGET // max(nk, 1)))
    outs = []
    for start in range(0, nq, block):
        stop = min(nq, start + block)
        visible = nk - nq + stop  # keys the block's last query sees
        rows = torch.arange(start, stop, device=q.device).unsqueeze(1) + (nk - nq)
        mask = torch.arange(visible, device=q.device).unsqueeze(0) <= rows  # [block, visible]
        outs.append(F.scaled_dot_product_attention(
            q[..., start:stop, :], k[..., :visible, :], v[..., :visible, :], attn_mask=mask,
            scale=scale, dropout_p=dropout_p, enable_gqa=gqa))
    return torch.cat(outs, dim=-2)


# ---------------------------------------------------------------------------
# flash
# ---------------------------------------------------------------------------


def _library(name: str):
    """The imported module ``name``, or None when it does not import (or a test hook hides it)."""
    if name in _LIBRARY_OVERRIDES:
        return _LIBRARY_OVERRIDES[name]
    try:
        return importlib.import_module(name)
    except Exception:
        return None


def _flash_attn_func() -> Optional[Callable]:
    return getattr(_library("flash_attn"), "flash_attn_varlen_func", None)


def _torch_varlen_func() -> Optional[Callable]:
    return getattr(_library("torch.nn.attention.varlen"), "varlen_attn", None)


def flash_impl_name() -> Optional[str]:
    if _flash_attn_func() is not None:
        return "flash_attn"
    if _torch_varlen_func() is not None:
        return "torch_varlen_attn"
    return None


def flash_varlen(q, k, v, seg: Segments, softmax_scale: float, dropout_p: float = 0.0):
    fn = _flash_attn_func()
    if fn is not None:
        # flash-attn >= 2.1: causal with seqlen_q != seqlen_k is bottom-right aligned.
        return fn(q, k, v, seg.cu_seqlens_q, seg.cu_seqlens_k, seg.max_seqlen_q, seg.max_seqlen_k,
                  dropout_p=dropout_p, softmax_scale=softmax_scale, causal=True)
    fn = _torch_varlen_func()
    params = inspect.signature(fn).parameters
    kwargs = {}
    if "scale" in params:
        kwargs["scale"] = softmax_scale
    elif abs(softmax_scale * math.sqrt(q.shape[-1]) - 1.0) > 1e-12:
        # The first varlen_attn (is_causal spelling) has no scale, always 1/sqrt(D): fold the ratio into q.
        q = q * (softmax_scale * math.sqrt(q.shape[-1]))
    if "window_size" in params:  # later torch: (-1, 0) is causal, bottom-right aligned
        kwargs["window_size"] = (-1, 0)
    else:  # the first varlen_attn spells it is_causal
        kwargs["is_causal"] = True
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return fn(q, k, v, seg.cu_seqlens_q, seg.cu_seqlens_k, seg.max_seqlen_q, seg.max_seqlen_k,
              **kwargs)


# ---------------------------------------------------------------------------
# te
# ---------------------------------------------------------------------------

_TE_MODULES: Dict[tuple, torch.nn.Module] = {}


def _te_pytorch():
    return _library("transformer_engine.pytorch")


def te_varlen(q, k, v, seg: Segments, softmax_scale: float, dropout_p: float = 0.0):
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    key = (hq, hkv, d, float(softmax_scale), float(dropout_p), q.device, q.dtype)
    module = _TE_MODULES.get(key)
    if module is None:
        te = _te_pytorch()
        module = te.DotProductAttention(
            num_attention_heads=hq, kv_channels=d, num_gqa_groups=hkv,
            attention_dropout=dropout_p, qkv_format="thd",
            attn_mask_type="padding_causal_bottom_right", softmax_scale=softmax_scale,
        ).to(device=q.device)
        _TE_MODULES[key] = module
    out = module(q, k, v, qkv_format="thd", attn_mask_type="padding_causal_bottom_right",
                 cu_seqlens_q=seg.cu_seqlens_q, cu_seqlens_kv=seg.cu_seqlens_k,
                 max_seqlen_q=seg.max_seqlen_q, max_seqlen_kv=seg.max_seqlen_k)
    return out.view(q.shape[0], hq, d)


# ---------------------------------------------------------------------------
# availability
# ---------------------------------------------------------------------------


def installed(backend: str) -> Tuple[bool, str]:
    """Whether ``backend``'s library imports here (says nothing of the device)."""
    override = _AVAILABILITY_OVERRIDES.get(backend)
    if override is not None and override.installed is not None:
        return override.installed
    if backend == "dense":
        return True, "torch SDPA is always available"
    if backend == "te":
        return (True, "TransformerEngine importable") if _te_pytorch() is not None else (
            False, "TransformerEngine is not installed (pip install megatron-ext[te])")
    name = flash_impl_name()
    return (True, f"{name} importable") if name else (
        False, "neither flash-attn nor torch.nn.attention.varlen is available")


def static_availability(backend: str, device: torch.device) -> Tuple[bool, str]:
    """What can be known before seeing q: installed, and a CUDA device."""
    override = _AVAILABILITY_OVERRIDES.get(backend)
    any_device = override is not None and override.any_device
    if backend != "dense" and not any_device and (
            torch.device(device).type != "cuda" or not torch.cuda.is_available()):
        # Decided before importing: torch's varlen module pulls in dynamo (1-2 s per process).
        return False, f"{backend} needs CUDA (device is {torch.device(device).type})"
    return installed(backend)


def call_availability(backend: str, q: torch.Tensor, dropout_p: float) -> Tuple[bool, str]:
    """What depends on the call: dtype, device, dropout."""
    if backend == "dense":
        return True, "dense takes any dtype"
    override = _AVAILABILITY_OVERRIDES.get(backend)
    if override is not None and override.any_call:
        return True, override.reason
    if q.device.type != "cuda":
        return False, f"{backend} needs CUDA tensors (got {q.device.type})"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return False, f"{backend} needs fp16/bf16 inputs (got {str(q.dtype).replace('torch.', '')})"
    if backend == "flash" and dropout_p > 0 and flash_impl_name() == "torch_varlen_attn":
        return False, "torch varlen_attn has no attention dropout"
    return True, "ok"


_KERNELS: Dict[str, Callable] = {"te": te_varlen, "flash": flash_varlen, "dense": dense_varlen}


def kernel_for(backend: str) -> Callable:
    """The kernel the engine calls for ``backend`` (the flash varlen contract above)."""
    return _KERNEL_OVERRIDES.get(backend) or _KERNELS[backend]


def default_softmax_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


# ---------------------------------------------------------------------------
# test hooks: set only through megatron_ext.testing, process-local, empty in production
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class AvailabilityOverride:
    """What a test makes one backend report on this process."""

    installed: Optional[Tuple[bool, str]]  # None: the real import check
    any_device: bool  # static check: skip the CUDA requirement (a CUDA machine's answer)
    any_call: bool  # call check: accept any dtype/device (a CPU double stands behind the backend)
    reason: str = "test override"


_KERNEL_OVERRIDES: Dict[str, Callable] = {}
_AVAILABILITY_OVERRIDES: Dict[str, AvailabilityOverride] = {}
_LIBRARY_OVERRIDES: Dict[str, object] = {}  # module name -> stand-in module, or None: "not importable"
