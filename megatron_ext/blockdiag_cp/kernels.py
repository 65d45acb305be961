"""Attention kernels with the log-sum-exp: dense (torch's CPU flash / math), flash varlen, TE fused.

Every kernel is a forward/backward pair over varlen segments (``Segments``):

    forward (q, k, v, seg, scale, dropout_p, seed)            -> out, lse, aux
    backward(dout, q, k, v, out, lse, aux, seg, scale, dropout_p) -> dq, dk, dv

    q [Nq, Hq, Dqk], k [Nk, Hkv, Dqk], v [Nk, Hkv, Dv]; out [Nq, Hq, Dv];
    lse [Nq, Hq] float32 (float64 for float64 inputs): log sum_j exp(scale * q.k_j)

Segment i's queries attend its keys either all of them (``seg.causal`` False: the
keys precede the queries) or causally on a square diagonal block (``seg.causal``
True: the same positions, where top-left and bottom-right alignment agree), so no
kernel ever needs an offset mask. A sliding window (``seg.window``, flash's
``window_size[0]`` in its bottom-right convention) further hides, for query i of n_q,
the keys j < i + (n_k - n_q) - window. ``backward`` takes the *final* out and lse of
the whole attention, not this call's: it then returns exactly this call's share
of the gradients (the rows' softmax normalizer and the dout.out correction are
global). That is what lets the streamed op attend K/V chunk by chunk, merge the
partial outputs by their lse, and differentiate each chunk on its own. ``aux`` is
what the backward needs to replay the forward's dropout (a seed, or the CUDA
kernel's RNG state). Hq % Hkv == 0 (GQA), never repeated into Hq heads on CUDA.
k and v may be the two halves of one received chunk ([t, h, 2, d], ``kv_halves``): ``te``
(as ``thd_th2d``) and ``flash`` read them in place, and hand dk / dv back the same way.

``te`` and ``flash`` are imported lazily and are only ever "available" on CUDA
with fp16/bf16 inputs; each availability check returns (ok, reason) and never
raises. Their library versions are gated (below) because their older releases
compute something else (top-left causal alignment) or lack the calls used here.
Every library call passes its arguments by name, the names read from the callable
(a custom op's from its schema), so a release that renames or drops one fails with
its name instead of binding a value to the wrong parameter; the releases tested,
and how, are in docs/backends.md.

The kernel table, the availability answers and the library lookups have test
hooks (the ``_*_OVERRIDES`` tables at the end). They are not part of the public
face: tests and benchmarks set them only through ``megatron_ext.testing``
(``override_kernel``, ``override_availability``, ``override_library``), which
restores them on exit.
"""

import functools
import importlib
import inspect
import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

# Largest score block (elements) the math path builds at once.
_MATH_BLOCK_BUDGET = 1 << 24


@dataclass(frozen=True)
class Segments:
    """Device-side varlen metadata of one kernel call."""

    cu_seqlens_q: torch.Tensor  # [n + 1] int32 on the kernel's device
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    q_lens: Tuple[int, ...]  # host copies, so the dense loop needs no device sync
    k_lens: Tuple[int, ...]
    causal: bool  # square diagonal blocks; else every key precedes every query
    window: Optional[int] = None  # bottom-right sliding window (see the module docstring); None: none


@dataclass(frozen=True)
class Kernel:
    """A forward/backward pair with the contract of this module's docstring."""

    forward: Callable
    backward: Callable


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------
# dense: torch's CPU flash kernel per segment, or explicit math (dropout, CUDA, MLA-style Dv)
# ---------------------------------------------------------------------------


def _cpu_flash_usable(q, v, dropout_p: float) -> bool:
    # torch's CPU flash kernel has no dropout and one head dim for q/k/v (wider v: zero-padded).
    return q.device.type == "cpu" and dropout_p == 0.0


def _window_binds(nq: int, nk: int, window: Optional[int]) -> bool:
    """Whether a window hides any key of a segment (the last query's lowest key is past the first)."""
    return window is not None and nk - 1 - window > 0


# A segment of at least this many rows goes to torch's CPU flash kernel copied head-major ([1, H, n, D]
# contiguous): on the strided view of [n, H, D] rows the kernel runs slower, by more than the copies cost at
# 4k-8k rows (fp32, 8 heads x 64, forward and backward); below, the copies cost about what they save
CPU_FLASH_HEAD_MAJOR_ROWS = 4096


def _as_4d(t: torch.Tensor, head_major: bool = False) -> torch.Tensor:
    t = t.transpose(0, 1)  # [n, H, D] -> [H, n, D]: a view
    return (t.contiguous() if head_major else t).unsqueeze(0)


def _pad_last(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))


def kv_halves(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether k and v [t, h, d] are the two halves of one [t, h, 2, d] buffer (a received chunk, split)."""
    if k.dim() != 3 or k.shape != v.shape or k.dtype != v.dtype or k.device != v.device:
        return False
    t, h, d = k.shape
    return (k.stride() == v.stride() == (2 * h * d, 2 * d, 1)
            and v.data_ptr() == k.data_ptr() + d * k.element_size())


def new_kv_halves(k: torch.Tensor, factory: Callable = torch.empty) -> Tuple[torch.Tensor, torch.Tensor]:
    """Two tensors shaped like k [t, h, d] that are the halves of one new [t, h, 2, d] buffer (``kv_halves``)."""
    return factory(k.shape[:2] + (2, k.shape[2]), dtype=k.dtype, device=k.device).unbind(2)


def kv_fused(k: torch.Tensor, v: torch.Tensor) -> Optional[torch.Tensor]:
    """The [t, h, 2 * d] buffer whose halves k and v are (``kv_halves``), as a view; else None."""
    if not kv_halves(k, v):
        return None
    t, h, d = k.shape
    return k.as_strided((t, h, 2 * d), (2 * h * d, 2 * d, 1))


def kv_planar(k: torch.Tensor, v: torch.Tensor) -> Optional[torch.Tensor]:
    """The [2, t, h, d] buffer whose [0] and [1] k and v are (a planar chunk, split), as a view; else None."""
    if (k.dim() != 3 or k.shape != v.shape or k.dtype != v.dtype or k.device != v.device
            or not k.is_contiguous() or not v.is_contiguous() or not k.numel()
            or v.data_ptr() != k.data_ptr() + k.numel() * k.element_size()
            or v.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()):  # one buffer, not neighbours
        return None
    return k.as_strided((2,) + tuple(k.shape), (k.numel(),) + k.stride())


def _segment_generator(seed: int, segment: int, device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + segment * 7_919) % (1 << 63))
    return gen


def _math_blocks(n: int, heads: int, m: int):
    block = max(1, _MATH_BLOCK_BUDGET // max(1, heads * m))
    return [(start, min(n, start + block)) for start in range(0, n, block)]


def _math_scores(qs, ks, causal: bool, start: int, stop: int, scale: float, acc, window=None):
    s = torch.einsum("qhd,khd->hqk", qs[start:stop].to(acc), ks.to(acc)) * scale  # [H, bq, m]
    rows = torch.arange(start, stop, device=qs.device).unsqueeze(1)
    cols = torch.arange(ks.shape[0], device=qs.device).unsqueeze(0)
    if causal:
        s = s.masked_fill(cols > rows, float("-inf"))
    if window is not None:
        s = s.masked_fill(cols < rows + (ks.shape[0] - qs.shape[0]) - window, float("-inf"))
    return s


def _math_keep(shape, dropout_p: float, gen, device) -> Optional[torch.Tensor]:
    if dropout_p == 0.0:
        return None
    return (torch.rand(shape, generator=gen, device=device) >= dropout_p).to(torch.float32) / (1.0 - dropout_p)


def _math_forward_segment(qs, ks, vs, causal, scale, dropout_p, gen, acc, window=None):
    rep = qs.shape[1] // ks.shape[1]
    ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)  # CPU/dense fallback only
    outs, lses = [], []
    for start, stop in _math_blocks(qs.shape[0], qs.shape[1], ks.shape[0]):
        s = _math_scores(qs, ks, causal, start, stop, scale, acc, window)
        lse = torch.logsumexp(s, dim=-1)  # [H, bq]
        p = torch.exp(s - lse.unsqueeze(-1))
        keep = _math_keep(p.shape, dropout_p, gen, qs.device)
        if keep is not None:
            p = p * keep.to(acc)
        outs.append(torch.einsum("hqk,khd->qhd", p, vs.to(acc)))
        lses.append(lse.t())
    return torch.cat(outs), torch.cat(lses)


def _math_backward_segment(dos, qs, ks, vs, os_, lses, causal, scale, dropout_p, gen, acc, window=None):
    hkv = ks.shape[1]
    rep = qs.shape[1] // hkv
    kr, vr = ks.repeat_interleave(rep, 1).to(acc), vs.repeat_interleave(rep, 1).to(acc)
    dq = torch.zeros(qs.shape, dtype=acc, device=qs.device)
    dk = torch.zeros(kr.shape, dtype=acc, device=qs.device)
    dv = torch.zeros(vr.shape, dtype=acc, device=qs.device)
    delta = (dos.to(acc) * os_.to(acc)).sum(-1)  # [n, H]: dout . out with the final out
    for start, stop in _math_blocks(qs.shape[0], qs.shape[1], ks.shape[0]):
        s = _math_scores(qs, kr, causal, start, stop, scale, acc, window)
        p = torch.exp(s - lses[start:stop].t().to(acc).unsqueeze(-1))  # final lse: this call's share
        keep = _math_keep(p.shape, dropout_p, gen, qs.device)
        do = dos[start:stop].to(acc)
        p_kept = p if keep is None else p * keep.to(acc)
        dv += torch.einsum("hqk,qhd->khd", p_kept, do)
        dp = torch.einsum("qhd,khd->hqk", do, vr)
        if keep is not None:
            dp = dp * keep.to(acc)
        ds = p * (dp - delta[start:stop].t().unsqueeze(-1))
        dq[start:stop] = torch.einsum("hqk,khd->qhd", ds, kr) * scale
        dk += torch.einsum("hqk,qhd->khd", ds, qs[start:stop].to(acc)) * scale
    fold = (ks.shape[0], hkv, rep)
    return dq, dk.view(*fold, -1).sum(2), dv.view(*fold, -1).sum(2)


def dense_forward(q, k, v, seg: Segments, scale: float, dropout_p: float = 0.0, seed: int = 0):
    """Per segment: torch's CPU flash kernel (returns the lse), else blockwise math; aux = seed."""
    acc = lse_dtype(q.dtype)
    out = q.new_empty(q.shape[:2] + v.shape[2:])
    lse = torch.empty(q.shape[:2], dtype=acc, device=q.device)
    fast = _cpu_flash_usable(q, v, dropout_p)
    width = max(q.shape[-1], v.shape[-1])
    parts = zip(q.split(seg.q_lens), k.split(seg.k_lens), v.split(seg.k_lens),
                out.split(seg.q_lens), lse.split(seg.q_lens))
    for i, (qs, ks, vs, os_, ls) in enumerate(parts):
        if fast and not _window_binds(qs.shape[0], ks.shape[0], seg.window):
            copy = max(qs.shape[0], ks.shape[0]) >= CPU_FLASH_HEAD_MAJOR_ROWS
            o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                *(_as_4d(_pad_last(t, width), copy) for t in (qs, ks, vs)), 0.0, seg.causal, scale=scale)
            os_.copy_(o[0, ..., :v.shape[-1]].transpose(0, 1))
            ls.copy_(l[0].t())
        else:
            o, l = _math_forward_segment(qs, ks, vs, seg.causal, scale, dropout_p,
                                         _segment_generator(seed, i, q.device), acc, seg.window)
            os_.copy_(o)
            ls.copy_(l)
    return out, lse, seed


def dense_backward(dout, q, k, v, out, lse, seed, seg: Segments, scale: float, dropout_p: float = 0.0):
    acc = lse_dtype(q.dtype)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fast = _cpu_flash_usable(q, v, dropout_p)
    width = max(q.shape[-1], v.shape[-1])
    parts = zip(dout.split(seg.q_lens), q.split(seg.q_lens), k.split(seg.k_lens), v.split(seg.k_lens),
                out.split(seg.q_lens), lse.split(seg.q_lens), dq.split(seg.q_lens), dk.split(seg.k_lens),
                dv.split(seg.k_lens))
    for i, (dos, qs, ks, vs, os_, ls, dqs, dks, dvs) in enumerate(parts):
        if fast and not _window_binds(qs.shape[0], ks.shape[0], seg.window):
            copy = max(qs.shape[0], ks.shape[0]) >= CPU_FLASH_HEAD_MAJOR_ROWS
            g = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                *(_as_4d(_pad_last(t, width), copy) for t in (dos, qs, ks, vs, os_)),
                ls.t().unsqueeze(0).to(acc if q.dtype == torch.float64 else torch.float32),
                0.0, seg.causal, scale=scale)
            grads = [x[0].transpose(0, 1) for x in g]
        else:
            grads = _math_backward_segment(dos, qs, ks, vs, os_, ls, seg.causal, scale, dropout_p,
                                           _segment_generator(seed, i, q.device), acc, seg.window)
        dqs.copy_(grads[0][..., :q.shape[-1]])
        dks.copy_(grads[1][..., :k.shape[-1]])
        dvs.copy_(grads[2][..., :v.shape[-1]])
    return dq, dk, dv


# ---------------------------------------------------------------------------
# library lookups (cached; test hooks may stand in)
# ---------------------------------------------------------------------------


def _library(name: str):
    """The imported module ``name``, or None when it does not import (or a test hook hides it)."""
    if name in _LIBRARY_OVERRIDES:
        return _LIBRARY_OVERRIDES[name]
    try:
        return importlib.import_module(name)
    except Exception:
        return None


def _schema_of(fn):
    """The dispatcher schema behind ``fn``: a ``torch.library.custom_op`` (its ``_opoverload``), a
    ``torch.ops`` packet (``.default``) or overload; None for a plain function."""
    for owner in (getattr(fn, "_opoverload", None), getattr(fn, "default", None), fn):
        schema = getattr(owner, "_schema", None)
        if schema is not None:
            return schema
    return None


@functools.lru_cache(maxsize=None)
def _parameters(fn) -> Tuple[str, ...]:
    """A callable's parameter names, from its schema where it has one, looked up once per callable.

    A custom op's ``inspect.signature`` is ``(*args, **kwargs)``: its names live in the schema only.
    """
    schema = _schema_of(fn)
    if schema is not None:
        return tuple(arg.name for arg in schema.arguments)
    try:
        return tuple(name for name, p in inspect.signature(fn).parameters.items()
                     if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    except (TypeError, ValueError):
        return ()


def _by_name(fn, library: str, required: Dict, optional: Dict = None) -> Dict:
    """Keyword arguments for ``fn``: every ``required`` one (an error naming what this release lacks,
    never a silently dropped argument), and the ``optional`` ones it takes."""
    names = _parameters(fn)
    lacking = [key for key in required if key not in names]
    if lacking:
        raise RuntimeError(f"{library}'s {getattr(fn, '__name__', fn)} takes no {', '.join(lacking)} "
                           f"(its parameters: {', '.join(names) or 'unknown'}): this release is not supported")
    return {**required, **{key: value for key, value in (optional or {}).items() if key in names}}


def _version_tuple(text) -> Tuple[int, ...]:
    out = []
    for part in str(text).split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


# ---------------------------------------------------------------------------
# flash: flash-attn's varlen forward/backward (>= 2.6), else torch's own flash ops
# ---------------------------------------------------------------------------

FLASH_ATTN_MIN = (2, 6)  # the oldest release tested (tests/engine/test_real_libraries.py): varlen calls with softcap
# flash-attn 2.7 made the private varlen calls torch.library custom ops, split window_size into
# window_size_left/right and cut the forward's 8 results (out, q, k, v, out_padded, lse, S_dmask,
# rng_state) to 4 (out, lse, S_dmask, rng_state).
FLASH_ATTN_FOUR_RESULTS = (2, 7)
FLASH_HEAD_DIM_MULTIPLE = 8  # flash's C++ (and torch's copy) takes head dims that are multiples of 8
TORCH_FLASH_OPS = "torch.ops.aten.flash"  # test-hook name of torch's _flash_attention_forward/backward


def _flash_attn_version() -> Tuple[int, ...]:
    lib = _library("flash_attn")
    return _version_tuple(getattr(lib, "__version__", "0")) if lib is not None else (0,)


def _flash_attn_interface():
    """flash-attn's interface module when its version has the calls used here, else None."""
    lib = _library("flash_attn")
    if lib is None or _flash_attn_version() < FLASH_ATTN_MIN:
        return None
    iface = _library("flash_attn.flash_attn_interface")
    if iface is None or not hasattr(iface, "_flash_attn_varlen_forward"):
        return None
    return iface


def _torch_flash_ops():
    if TORCH_FLASH_OPS in _LIBRARY_OVERRIDES:
        return _LIBRARY_OVERRIDES[TORCH_FLASH_OPS]
    aten = torch.ops.aten
    if hasattr(aten, "_flash_attention_forward") and hasattr(aten, "_flash_attention_backward"):
        return aten
    return None


def flash_impl_name() -> Optional[str]:
    if _flash_attn_interface() is not None:
        return "flash_attn"
    if _torch_flash_ops() is not None and _library("torch.nn.attention.varlen") is not None:
        return "torch_varlen_attn"
    return None


def _flash_lse_rows(lse: torch.Tensor, nq: int) -> torch.Tensor:
    # Varlen flash returns the lse as [H, total_q]; ours is [total_q, H].
    if lse.dim() != 2 or lse.shape[1] != nq:
        raise RuntimeError(f"flash returned an lse of shape {tuple(lse.shape)}; expected [heads, {nq}] "
                           "(varlen, unpadded): this flash version is not supported")
    return lse.t()


def _flash_window(seg: Segments) -> Tuple[int, int]:
    # flash's (left, right): -1 is unbounded; a causal segment's right edge is the diagonal.
    return (-1 if seg.window is None else seg.window), (0 if seg.causal else -1)


def _flash_window_args(fn, seg: Segments) -> Dict:
    """flash-attn's window arguments: window_size_left/right from 2.7, one window_size pair before."""
    left, right = _flash_window(seg)
    if "window_size" in _parameters(fn):
        return {"window_size": (left, right)}
    return {"window_size_left": left, "window_size_right": right}


def _flash_max_seqlen_k(seg: Segments) -> int:
    # flash-attn 2 opens a window's right edge only max_seqlen_k past each segment's bottom-right
    # diagonal (flash_api.cpp: window_size_right = seqlen_k), so in a band with more queries than
    # max_seqlen_k + 1 the first queries would see no key (lse +inf, out 0). At least max_seqlen_q puts
    # the edge past every key; flash takes max_seqlen_k as a bound, not a size.
    if seg.window is None or seg.causal:
        return seg.max_seqlen_k
    return max(seg.max_seqlen_k, seg.max_seqlen_q)


def _flash_width(q, v) -> int:
    # flash takes one head dim for q, k and v, a multiple of 8: a narrower V (MLA) or an odd head dim
    # is zero-padded (exact: zero columns add nothing to q.k, and the cut output columns are zero).
    return _round_up(max(q.shape[-1], v.shape[-1]), FLASH_HEAD_DIM_MULTIPLE)


def _flash_padded(t: torch.Tensor, width: int) -> torch.Tensor:
    # flash reads rows and heads by their strides and needs only a contiguous last dim: a received
    # chunk's K and V halves go in as they are
    t = _pad_last(t, width)
    return t if t.stride(-1) == 1 else t.contiguous()


def flash_forward(q, k, v, seg: Segments, scale: float, dropout_p: float = 0.0, seed: int = 0):
    width, dv = _flash_width(q, v), v.shape[-1]
    q, k, v = (_flash_padded(t, width) for t in (q, k, v))
    iface = _flash_attn_interface()
    if iface is not None:
        fn = iface._flash_attn_varlen_forward
        res = fn(**_by_name(
            fn, "flash-attn",
            dict(q=q, k=k, v=v, cu_seqlens_q=seg.cu_seqlens_q, cu_seqlens_k=seg.cu_seqlens_k,
                 max_seqlen_q=seg.max_seqlen_q, max_seqlen_k=_flash_max_seqlen_k(seg), dropout_p=dropout_p,
                 softmax_scale=scale, causal=seg.causal, **_flash_window_args(fn, seg)),
            dict(softcap=0.0, alibi_slopes=None, return_softmax=False)))
        lse_at = 1 if _flash_attn_version() >= FLASH_ATTN_FOUR_RESULTS else 5
        out, lse, aux = res[0], res[lse_at], ("flash_attn", res[-1])
    else:
        fn = _torch_flash_ops()._flash_attention_forward
        window = {} if seg.window is None else dict(zip(("window_size_left", "window_size_right"),
                                                         _flash_window(seg)))
        out, lse, rng_state, unused, _ = fn(
            query=q, key=k, value=v, cum_seq_q=seg.cu_seqlens_q, cum_seq_k=seg.cu_seqlens_k,
            max_q=seg.max_seqlen_q, max_k=_flash_max_seqlen_k(seg), dropout_p=dropout_p, is_causal=seg.causal,
            return_debug_mask=False, scale=scale, **window)
        aux = ("torch", (rng_state, unused))
    return out[..., :dv], _flash_lse_rows(lse, q.shape[0]), aux


def flash_backward(dout, q, k, v, out, lse, aux, seg: Segments, scale: float, dropout_p: float = 0.0):
    impl, state = aux
    width, dk, dv = _flash_width(q, v), k.shape[-1], v.shape[-1]
    q, k, v, dout, out = (_flash_padded(t, width) for t in (q, k, v, dout, out))
    lse_hq = lse.t().contiguous().float()  # back to the kernel's [H, total_q]
    cu = dict(cu_seqlens_q=seg.cu_seqlens_q, cu_seqlens_k=seg.cu_seqlens_k, max_seqlen_q=seg.max_seqlen_q,
              max_seqlen_k=_flash_max_seqlen_k(seg))
    if impl == "flash_attn":
        fn = _flash_attn_interface()._flash_attn_varlen_backward
        dq = torch.empty_like(q)
        if kv_halves(k, v):  # flash writes dk / dv by their strides: one [t, h, 2, d] buffer, as the chunk
            dk_, dv_ = new_kv_halves(k)
        else:
            dk_, dv_ = torch.empty_like(k), torch.empty_like(v)
        # Every argument by name: from 2.7 window_size_left/right, softcap, alibi_slopes and
        # deterministic have no defaults in the custom op's schema.
        fn(**_by_name(
            fn, "flash-attn",
            dict(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse_hq, dq=dq, dk=dk_, dv=dv_, **cu,
                 dropout_p=dropout_p, softmax_scale=scale, causal=seg.causal, **_flash_window_args(fn, seg),
                 softcap=0.0, alibi_slopes=None, deterministic=False, rng_state=state)))
    else:
        rng_state, unused = state
        window = {} if seg.window is None else dict(zip(("window_size_left", "window_size_right"),
                                                         _flash_window(seg)))
        dq, dk_, dv_ = _torch_flash_ops()._flash_attention_backward(
            grad_out=dout, query=q, key=k, value=v, out=out, logsumexp=lse_hq, cum_seq_q=seg.cu_seqlens_q,
            cum_seq_k=seg.cu_seqlens_k, max_q=seg.max_seqlen_q, max_k=_flash_max_seqlen_k(seg),
            dropout_p=dropout_p, is_causal=seg.causal, rng_state=rng_state, unused=unused, scale=scale, **window)
    return dq[..., :dk], dk_[..., :dk], dv_[..., :dv]


def flash_supports_window() -> bool:
    """flash-attn 2.6+ always; torch's flash ops where their schema has window_size_left."""
    if _flash_attn_interface() is not None:
        return True
    ops = _torch_flash_ops()
    return ops is not None and "window_size_left" in _parameters(ops._flash_attention_forward)


# ---------------------------------------------------------------------------
# te: TransformerEngine's fused attention (cuDNN), thd, with its softmax stats
# ---------------------------------------------------------------------------

TE_MIN = (2, 1)  # 1.x: fused_attn_fwd/bwd take a tex.DType qkv_dtype and FP8 scale tensors (2.0 never shipped)
TE_FUSED_ATTN = "transformer_engine.pytorch.cpp_extensions.fused_attn"
TE_CONSTANTS = "transformer_engine.pytorch.constants"
CUDNN_THD_GQA_MIN = 90600  # cuDNN 9.6: THD with fewer K/V heads than query heads


def _te_pytorch():
    return _library("transformer_engine.pytorch")


def _te_version() -> Tuple[int, ...]:
    te = _library("transformer_engine")
    return _version_tuple(getattr(te, "__version__", "0")) if te is not None else (0,)


def te_cudnn_version() -> int:
    """cuDNN's version as TE reports it (e.g. 90600), 0 when unknown."""
    tex = _library("transformer_engine_torch")
    get = getattr(tex, "get_cudnn_version", None)
    try:
        return int(get()) if get is not None else int(torch.backends.cudnn.version() or 0)
    except Exception:
        return 0


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _te_stats_rows(stats: torch.Tensor, seg: Segments) -> torch.Tensor:
    """TE's softmax stats -> [total_q, H]: [tq, h, 1] (newer cuDNN) or [b, h, sq, 1] (older)."""
    if stats.dim() == 3:
        return stats[..., 0]
    rows = [stats[i, :, :n, 0].t() for i, n in enumerate(seg.q_lens)]
    return torch.cat(rows) if rows else stats.new_empty(0, stats.shape[1])


def _te_stats_like(lse: torch.Tensor, like: torch.Tensor, seg: Segments) -> torch.Tensor:
    """The final lse in the layout TE's forward gave its stats."""
    if like.dim() == 3:
        return lse.to(like.dtype).unsqueeze(-1).contiguous()
    stats = torch.zeros_like(like)
    for i, part in enumerate(lse.split(seg.q_lens)):
        stats[i, :, :part.shape[0], 0] = part.t()
    return stats


def _te_call_args(seg: Segments):
    # cuDNN >= 9.6 wants max_seqlen % 64 == 0 for THD; rounding up is harmless on older ones.
    mask = "padding_causal" if seg.causal else "padding"
    return (_round_up(seg.max_seqlen_q, 64), _round_up(seg.max_seqlen_k, 64), seg.cu_seqlens_q,
            seg.cu_seqlens_k), mask


def _te_backend(fa):
    return fa.FusedAttnBackend["F16_arbitrary_seqlen"]


def _te_window(fn, seg: Segments) -> Dict:
    if seg.window is None:
        return {}
    # Only offered where fused_attn has bottom_right_diagonal (te_supports_window): a full segment's
    # window is measured from its bottom-right corner, as flash's.
    return dict(window_size=(seg.window, 0 if seg.causal else -1), bottom_right_diagonal=True)


def te_supports_window() -> bool:
    fa = _library(TE_FUSED_ATTN)
    names = _parameters(fa.fused_attn_fwd) if fa is not None else ()
    return "window_size" in names and "bottom_right_diagonal" in names


def _te_dtype(dtype: torch.dtype):
    """TE's ``tex.DType`` of a torch dtype (what fused_attn_bwd's dqkv_dtype takes up to TE 2.14)."""
    constants = _library(TE_CONSTANTS)
    table = getattr(constants, "TE_DType", None)
    if table is None or dtype not in table:
        raise RuntimeError(f"TransformerEngine {'.'.join(map(str, _te_version()))} has no "
                           f"{TE_CONSTANTS}.TE_DType entry for {dtype}")
    return table[dtype]


def _te_inputs(q, k, v):
    """q, k, v as TE's C++ reads them, and their layout: it takes data pointers and derives every stride
    from the layout. K and V halves of one buffer go in place as ``thd_th2d``; anything else is copied
    contiguous for ``thd_thd_thd``."""
    if kv_halves(k, v):
        return q.contiguous(), k, v, "thd_th2d"
    return q.contiguous(), k.contiguous(), v.contiguous(), "thd_thd_thd"


def _te_call(fn, seg: Segments, q, k, v, scale: float, dropout_p: float, layout: str) -> Dict:
    """The arguments fused_attn_fwd and fused_attn_bwd share, by name."""
    (max_q, max_k, cu_q, cu_k), mask = _te_call_args(seg)
    return dict(max_seqlen_q=max_q, max_seqlen_kv=max_k, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, q=q, k=k, v=v,
                fake_dtype=q.dtype, fused_attention_backend=_te_backend(_library(TE_FUSED_ATTN)),
                attn_scale=scale, dropout=dropout_p, qkv_layout=layout, attn_mask_type=mask,
                **_te_window(fn, seg))


def te_forward(q, k, v, seg: Segments, scale: float, dropout_p: float = 0.0, seed: int = 0):
    fn = _library(TE_FUSED_ATTN).fused_attn_fwd
    q, k, v, layout = _te_inputs(q, k, v)
    out, aux = fn(**_by_name(fn, "TransformerEngine",
                             dict(is_training=True, **_te_call(fn, seg, q, k, v, scale, dropout_p, layout)),
                             dict(o_format="thd")))[:2]
    out = out.view(q.shape[0], q.shape[1], v.shape[-1])
    return out, _te_stats_rows(aux[0], seg).to(lse_dtype(q.dtype)), list(aux)


def te_backward(dout, q, k, v, out, lse, aux, seg: Segments, scale: float, dropout_p: float = 0.0):
    fn = _library(TE_FUSED_ATTN).fused_attn_bwd
    aux = [_te_stats_like(lse, aux[0], seg)] + list(aux[1:])
    q, k, v, layout = _te_inputs(q, k, v)
    required = dict(o=out.contiguous(), d_o=dout.contiguous(), aux_ctx_tensors=aux,
                    **_te_call(fn, seg, q, k, v, scale, dropout_p, layout))
    if "dqkv_dtype" in _parameters(fn):  # TE 2.1-2.14: a required tex.DType (2.15 dropped it)
        required["dqkv_dtype"] = _te_dtype(q.dtype)
    # dk and dv in the inputs' layout: with thd_th2d they come back as the halves of one buffer, which the
    # op sends home as it is (``kv_halves``)
    grads = fn(**_by_name(fn, "TransformerEngine", required,
                          dict(o_format="thd", do_format="thd", dqkv_layout=layout)))
    return grads[0], grads[1], grads[2]


# ---------------------------------------------------------------------------
# availability
# ---------------------------------------------------------------------------


def installed(backend: str) -> Tuple[bool, str]:
    """Whether ``backend``'s library imports here at a usable version (says nothing of the device)."""
    override = _AVAILABILITY_OVERRIDES.get(backend)
    if override is not None and override.installed is not None:
        return override.installed
    if backend == "dense":
        return True, "torch SDPA is always available"
    if backend == "te":
        if _te_pytorch() is None:
            return False, "TransformerEngine is not installed (pip install megatron-ext[te])"
        version = _te_version()
        if version < TE_MIN:
            return False, (f"TransformerEngine {'.'.join(map(str, version))} is older than "
                           f"{'.'.join(map(str, TE_MIN))} (its fused_attn_fwd/bwd take a tex.DType qkv_dtype); "
                           f"upgrade it: pip install 'transformer-engine[pytorch]>={'.'.join(map(str, TE_MIN))}'")
        if _library(TE_FUSED_ATTN) is None:
            return False, "TransformerEngine has no cpp_extensions.fused_attn (fused_attn_fwd/bwd)"
        return True, "TransformerEngine importable"
    name = flash_impl_name()
    if name:
        return True, f"{name} importable"
    lib = _library("flash_attn")
    if lib is not None:
        return False, (f"flash-attn {getattr(lib, '__version__', '?')} is older than "
                       f"{'.'.join(map(str, FLASH_ATTN_MIN))} (before 2.1 its causal mask is top-left "
                       "aligned; before 2.6 its varlen forward/backward differ) and torch has no "
                       "flash ops; upgrade flash-attn: pip install 'flash-attn>="
                       f"{'.'.join(map(str, FLASH_ATTN_MIN))}' --no-build-isolation")
    return False, "neither flash-attn nor torch.nn.attention.varlen is available"


def static_availability(backend: str, device: torch.device) -> Tuple[bool, str]:
    """What can be known before seeing q: installed, and a CUDA device."""
    override = _AVAILABILITY_OVERRIDES.get(backend)
    any_device = override is not None and override.any_device
    if backend != "dense" and not any_device and (
            torch.device(device).type != "cuda" or not torch.cuda.is_available()):
        # Decided before importing: torch's varlen module pulls in dynamo (1-2 s per process).
        return False, f"{backend} needs CUDA (device is {torch.device(device).type})"
    return installed(backend)


def call_availability(backend: str, q: torch.Tensor, dropout_p: float, kv_heads: int = None,
                      window: Optional[int] = None) -> Tuple[bool, str]:
    """What depends on the call: dtype, device, dropout, grouped K/V heads, a sliding window."""
    if backend == "dense":
        return True, "dense takes any dtype"
    if window is not None:  # a library feature: asked even of a test double standing in for the library
        if backend == "flash" and not flash_supports_window():
            return False, "this torch's flash ops take no sliding window (window_size_left)"
        if backend == "te" and not te_supports_window():
            return False, ("this TransformerEngine's fused_attn_fwd has no window_size/bottom_right_diagonal "
                           "for sliding windows")
    override = _AVAILABILITY_OVERRIDES.get(backend)
    if override is not None and override.any_call:
        return True, override.reason
    if q.device.type != "cuda":
        return False, f"{backend} needs CUDA tensors (got {q.device.type})"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return False, f"{backend} needs fp16/bf16 inputs (got {str(q.dtype).replace('torch.', '')})"
    if backend == "te" and kv_heads is not None and kv_heads != q.shape[-2]:
        cudnn = te_cudnn_version()
        if cudnn < CUDNN_THD_GQA_MIN:
            # Below 9.6 TE silently takes its unfused path, which pads THD to [segments, max_seqlen].
            return False, (f"te needs cuDNN >= 9.6 for THD with grouped K/V heads (found {cudnn}); "
                           "TE would fall back to its unfused path and pad every segment")
    return True, "ok"


_KERNELS: Dict[str, Kernel] = {
    "te": Kernel(te_forward, te_backward),
    "flash": Kernel(flash_forward, flash_backward),
    "dense": Kernel(dense_forward, dense_backward),
}


def kernel_for(backend: str) -> Kernel:
    """The forward/backward pair the engine calls for ``backend`` (the contract above)."""
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


_KERNEL_OVERRIDES: Dict[str, Kernel] = {}
_AVAILABILITY_OVERRIDES: Dict[str, AvailabilityOverride] = {}
_LIBRARY_OVERRIDES: Dict[str, object] = {}  # module name -> stand-in module, or None: "not importable"
