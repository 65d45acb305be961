"""One fused log-sum-exp merge of a kernel call's rows into the float32 merge buffer or the result.

``merge_rows_(acc_out, acc_lse, out, lse, source, target)`` does, for each i,

    r, t = source[i], target[i]                  (identity where None)
    new = logaddexp(acc_lse[t], lse[r])
    acc_out[t] += exp(lse[r] - new) * (out[r] - acc_out[t])       # [H, D], in acc_lse's dtype
    acc_lse[t] = new

in one pass. acc_out is the float32 merge buffer, or the result itself in the input
dtype (a row two calls write: the second merges into the first's output, rounded
once). The op reads the call's rows where they lie (no gathered copy), reads and
writes the buffer's rows once (no gather / scatter pair around the math) and casts
on the way. Per merged element that is 2 bytes of a bf16 output and 8 of the
float32 buffer; the same merge as separate torch ops (cast, lerp, index_select and
index_copy_ for scattered rows) moves 18-34 and launches 6-9 ops.

It is one op of the dispatcher (``torch.ops.megatron_ext.merge_rows_``), so an op
counter (``testing.op_counter``) and the bench's replay see and price one launch:

- on CUDA with Triton importable (PyPI's torch builds ship it): the Triton kernel
  ``_merge_rows_kernel``, one program per (row, block of heads);
- everywhere else (CPU, CUDA without Triton): ``merge_rows_eager``, the same
  arithmetic as torch ops.

The Triton kernel runs on CPU tensors under ``TRITON_INTERPRET=1`` (the tests run it
against ``merge_rows_eager`` that way: ``triton_merge_rows_``).
"""

import functools
from typing import Optional

import torch

_LIB = torch.library.Library("megatron_ext", "DEF")  # the op's registration (the dispatcher holds it)
_LIB.define("merge_rows_(Tensor(a!) acc_out, Tensor(b!) acc_lse, Tensor out, Tensor lse, "
            "Tensor? source, Tensor? target) -> ()")


def merge_rows_eager(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                     source: Optional[torch.Tensor], target: Optional[torch.Tensor]) -> None:
    """``merge_rows_`` as torch ops: acc_out [N, H, D] (float32 buffer, or the result in the input dtype),
    acc_lse [N, H] (the merge's dtype), out [n', H, D], lse [n', H], source / target [n] int64 rows of
    out / acc (None: rows 0..n-1). The merge runs in acc_lse's dtype, rounded once into acc_out."""
    dtype = acc_lse.dtype
    if source is not None:
        out, lse = out.index_select(0, source), lse.index_select(0, source)
    out, lse = out.to(dtype), lse.to(dtype)
    old_out = acc_out if target is None else acc_out.index_select(0, target)
    old_out = old_out.to(dtype)  # acc_out itself when it is the buffer (in place on a run)
    old_lse = acc_lse if target is None else acc_lse.index_select(0, target)
    new_lse = torch.logaddexp(old_lse, lse)  # every row of a call sees >= 1 key: finite
    # old * exp(old_lse - new_lse) + out * exp(lse - new_lse): the weights sum to 1, so one pass
    old_out.lerp_(out, torch.exp(lse - new_lse).unsqueeze(-1))
    if target is None:
        old_lse.copy_(new_lse)
        if old_out.data_ptr() != acc_out.data_ptr():
            acc_out.copy_(old_out)
    else:
        acc_out.index_copy_(0, target, old_out.to(acc_out.dtype))
        acc_lse.index_copy_(0, target, new_lse)


def merge_rows_(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                source: Optional[torch.Tensor] = None, target: Optional[torch.Tensor] = None) -> None:
    """Merge ``out`` / ``lse``'s rows ``source`` into ``acc_out`` / ``acc_lse``'s rows ``target`` (one op)."""
    torch.ops.megatron_ext.merge_rows_(acc_out, acc_lse, out, lse, source, target)


def _check(acc_out, acc_lse, out, lse, source, target) -> None:
    n = out.shape[0] if source is None else source.numel()
    targets = acc_out.shape[0] if target is None else target.numel()
    if targets != n:
        raise ValueError(f"merge_rows_: {n} source rows against {targets} target rows")
    if not acc_lse.dtype.is_floating_point or out.shape[1:] != acc_out.shape[1:] or lse.shape[1:] != acc_lse.shape[1:]:
        raise ValueError(f"merge_rows_: acc {tuple(acc_out.shape)} {acc_out.dtype} / {tuple(acc_lse.shape)} "
                         f"{acc_lse.dtype} against out {tuple(out.shape)} / lse {tuple(lse.shape)}")


@functools.lru_cache(maxsize=None)
def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)  # the jitted kernel, made on first use (importing Triton is slow and optional)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _merge_rows_kernel(acc_out, acc_lse, out, lse, source, target, H, D,
                           sa_n, sa_h, sa_d, sal_n, sal_h, so_n, so_h, so_d, sl_n, sl_h,
                           HAS_SOURCE: tl.constexpr, HAS_TARGET: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        i = tl.program_id(0)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
        d = tl.arange(0, BLOCK_D)  # [BD]
        if HAS_SOURCE:
            r = tl.load(source + i).to(tl.int64)
        else:
            r = i.to(tl.int64)
        if HAS_TARGET:
            t = tl.load(target + i).to(tl.int64)
        else:
            t = i.to(tl.int64)
        mh = h < H
        m = mh[:, None] & (d < D)[None, :]
        acc_t = acc_lse.dtype.element_ty  # the merge's dtype (float32; float64 in fp64 runs)
        lse_new = tl.load(lse + r * sl_n + h * sl_h, mask=mh, other=0.0).to(acc_t)  # [BH]
        lse_old = tl.load(acc_lse + t * sal_n + h * sal_h, mask=mh, other=0.0)
        top = tl.maximum(lse_old, lse_new)  # lse_new is finite, so top is
        merged = top + tl.log(tl.exp(lse_old - top) + tl.exp(lse_new - top))
        w = tl.exp(lse_new - merged)
        o_new = tl.load(out + r * so_n + h[:, None] * so_h + d[None, :] * so_d, mask=m, other=0.0).to(acc_t)
        at = acc_out + t * sa_n + h[:, None] * sa_h + d[None, :] * sa_d
        o_old = tl.load(at, mask=m, other=0.0).to(acc_t)
        tl.store(at, (o_old + w[:, None] * (o_new - o_old)).to(acc_out.dtype.element_ty), mask=m)
        tl.store(acc_lse + t * sal_n + h * sal_h, merged, mask=mh)

    return _merge_rows_kernel


def triton_merge_rows_(acc_out, acc_lse, out, lse, source=None, target=None) -> None:
    """``merge_rows_`` through the Triton kernel (CUDA tensors, or CPU ones under TRITON_INTERPRET=1)."""
    import triton

    _check(acc_out, acc_lse, out, lse, source, target)
    n = out.shape[0] if source is None else source.numel()
    H, D = acc_out.shape[1], acc_out.shape[2]
    if n == 0:
        return
    block_d = triton.next_power_of_2(D)
    block_h = max(1, min(triton.next_power_of_2(H), 4096 // block_d))  # a program's tile: <= 4k elements
    dummy = acc_lse  # a pointer for an absent index (never read)
    _kernel()[(n, triton.cdiv(H, block_h))](
        acc_out, acc_lse, out, lse, dummy if source is None else source, dummy if target is None else target,
        H, D, *acc_out.stride(), *acc_lse.stride(), *out.stride(), *lse.stride(),
        HAS_SOURCE=source is not None, HAS_TARGET=target is not None, BLOCK_H=block_h, BLOCK_D=block_d)


def _merge_rows_cpu(acc_out, acc_lse, out, lse, source, target) -> None:
    _check(acc_out, acc_lse, out, lse, source, target)
    merge_rows_eager(acc_out, acc_lse, out, lse, source, target)


def _merge_rows_cuda(acc_out, acc_lse, out, lse, source, target) -> None:
    if not _triton_imports():
        _merge_rows_cpu(acc_out, acc_lse, out, lse, source, target)
    else:
        triton_merge_rows_(acc_out, acc_lse, out, lse, source, target)


def _merge_rows_meta(acc_out, acc_lse, out, lse, source, target) -> None:
    _check(acc_out, acc_lse, out, lse, source, target)


_LIB.impl("merge_rows_", _merge_rows_cpu, "CPU")
_LIB.impl("merge_rows_", _merge_rows_cuda, "CUDA")
_LIB.impl("merge_rows_", _merge_rows_meta, "Meta")

__all__ = ["merge_rows_", "merge_rows_eager", "triton_merge_rows_"]
