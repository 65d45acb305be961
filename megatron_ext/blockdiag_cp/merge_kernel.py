"""Fused row ops of the merges: a log-sum-exp merge of a kernel call's rows into the float32 merge
buffer or the result (``merge_rows_``), and rows gathered, cast and scattered or added in one pass
(``copy_rows_``, ``add_rows_``, and ``sum_rows_`` for rows that several arrivals add to).

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

With ``dst_out`` / ``dst_lse`` (rows ``dst_target``) the merged rows are written there
instead, and acc_out's rows are no longer the result (the Triton kernel only reads
them; the eager body merges a run of them in place on the way, as no caller reads
them again): a row's second writer merges the first's output (in the result) into
the float32 buffer, its last writer merges the buffer into the result, so no pass
copies into the buffer or back out of it.

It is one op of the dispatcher (``torch.ops.megatron_ext.merge_rows_``), so an op
counter (``testing.op_counter``) and the bench's replay see and price one launch:

- on CUDA with Triton importable (PyPI's torch builds ship it): the Triton kernel
  ``_merge_rows_kernel``, one program per (row, block of heads);
- everywhere else (CPU, CUDA without Triton): ``merge_rows_eager``, the same
  arithmetic as torch ops.

``copy_rows_(dst, src, source, target)`` (``add_rows_``: adds) does, for each i,

    dst[target[i]] = src[source[i]]    (add_rows_: +=), in dst's dtype    (identity where None)

in one pass: the rows a returned key gradient, a call's dq or a write-back moves into a
float32 buffer or out of it are read where they lie and cast on the way. As torch ops a
scattered add of bf16 rows into float32 is a cast and an index_add_ (18 bytes per
element against 10), and a gathered source one pass more. Added rows that repeat in
``target`` all land (atomic adds in the Triton kernel, as index_add_ on CUDA). Two ops,
so that an op counter tells a copy from an add by name; on CUDA the Triton kernel
``_rows_into_kernel`` where Triton imports (adds only into float32 / float64: the
buffers'), else the eager body ``rows_into_eager``.

``sum_rows_(dst, src, source, offsets, target)`` does, for each j,

    dst[target[j]] += src[source[offsets[j]]] + ... + src[source[offsets[j + 1] - 1]]    (in dst's dtype)

with ``target`` naming each row once: the gradients several ranks send back for one key row,
arriving together (a band group's one batch, the hierarchical routes' return), each row summed
in registers and its float32 row read and written once. ``add_rows_`` over the same rows reads
and writes that row once per arrival (atomically); at the 6.5 arrivals a row of `thd` at 128k /
cp 8 gets per band group, that is about three times the bytes. The eager body adds a row's
arrivals in ``source``'s order (``merge.RowSums`` lists each row's ascending: ``add_rows_``'s
bits over the arrival).
On CUDA the Triton kernel ``_sum_rows_kernel`` where Triton imports (into float32 / float64,
the buffers'), one program per (target row, block of heads), else the eager body
``sum_rows_eager``.

``gather_kv_rows_(dst, k, v, index)`` does, for each i,

    dst[i, c, :Dk] = k[index[i], c]    dst[i, c, Dk:] = v[index[i], c]    (c: every (batch, head))

in one pass: a send buffer of K and V rows side by side (``exchange.fused_rows``) in one launch, where
two gathers into its halves would take two. On CUDA the Triton kernel ``_gather_kv_kernel`` where Triton
imports, else (and on CPU) ``gather_kv_rows_eager``, the two gathers.

The Triton kernels run on CPU tensors under ``TRITON_INTERPRET=1`` (the tests run them
against the eager bodies that way: ``triton_merge_rows_``, ``triton_rows_into_``, ``triton_gather_kv_rows_``).
"""

import functools
from typing import Optional

import torch

_LIB = torch.library.Library("megatron_ext", "DEF")  # the op's registration (the dispatcher holds it)
_LIB.define("merge_rows_(Tensor(a!) acc_out, Tensor(b!) acc_lse, Tensor out, Tensor lse, "
            "Tensor? source, Tensor? target, Tensor(c!)? dst_out=None, Tensor(d!)? dst_lse=None, "
            "Tensor? dst_target=None) -> ()")
_LIB.define("copy_rows_(Tensor(a!) dst, Tensor src, Tensor? source, Tensor? target) -> ()")
_LIB.define("add_rows_(Tensor(a!) dst, Tensor src, Tensor? source, Tensor? target) -> ()")
_LIB.define("gather_kv_rows_(Tensor(a!) dst, Tensor k, Tensor v, Tensor index) -> ()")
_LIB.define("sum_rows_(Tensor(a!) dst, Tensor src, Tensor source, Tensor offsets, Tensor target) -> ()")


def merge_rows_eager(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                     source: Optional[torch.Tensor], target: Optional[torch.Tensor],
                     dst_out: Optional[torch.Tensor] = None, dst_lse: Optional[torch.Tensor] = None,
                     dst_target: Optional[torch.Tensor] = None) -> None:
    """``merge_rows_`` as torch ops: acc_out [N, H, D] (float32 buffer, or the result in the input dtype),
    acc_lse [N, H] (the merge's dtype), out [n', H, D], lse [n', H], source / target [n] int64 rows of
    out / acc (None: rows 0..n-1). The merge runs in acc_lse's dtype, rounded once into acc_out, or into
    ``dst_out`` / ``dst_lse``'s rows ``dst_target`` where given (acc's rows are then not the result: a run
    of them in the merge's dtype is merged in place on the way, acc_lse only read)."""
    dtype = acc_lse.dtype
    if dst_out is None:  # in place: the rows read are the rows written
        dst_out, dst_lse, dst_target = acc_out, acc_lse, target
    if source is not None:
        out, lse = out.index_select(0, source), lse.index_select(0, source)
    out, lse = out.to(dtype), lse.to(dtype)
    old_out = acc_out if target is None else acc_out.index_select(0, target)
    old_lse = acc_lse if target is None else acc_lse.index_select(0, target)
    new_lse = torch.logaddexp(old_lse, lse)  # every row of a call sees >= 1 key: finite
    # old * exp(old_lse - new_lse) + out * exp(lse - new_lse): the weights sum to 1, so one pass
    weight = torch.exp(lse - new_lse).unsqueeze(-1)
    # Merged in tensors that exist already where it can (a fresh one costs its page faults on CPU): a
    # destination run in the merge's dtype the old rows are copied into, the old rows where they lie in
    # that dtype (acc's own run: with a destination its rows hold the merged values after, unlike the
    # Triton kernel's), the gathered copy; else a copy in the merge's dtype
    if old_out.dtype == dtype:
        if dst_target is None and dst_out.dtype == dtype and old_out is not dst_out:
            old_out = dst_out.copy_(old_out)
        merged = old_out.lerp_(out, weight)
    elif dst_target is None and dst_out.dtype == dtype:
        merged = dst_out.copy_(old_out).lerp_(out, weight)
    else:
        merged = old_out.to(dtype).lerp_(out, weight)
    if dst_target is None:
        if merged is not dst_out:
            dst_out.copy_(merged)
        dst_lse.copy_(new_lse)
    else:
        dst_out.index_copy_(0, dst_target, merged.to(dst_out.dtype))
        dst_lse.index_copy_(0, dst_target, new_lse.to(dst_lse.dtype))


def merge_rows_(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                source: Optional[torch.Tensor] = None, target: Optional[torch.Tensor] = None,
                dst_out: Optional[torch.Tensor] = None, dst_lse: Optional[torch.Tensor] = None,
                dst_target: Optional[torch.Tensor] = None) -> None:
    """Merge ``out`` / ``lse``'s rows ``source`` into ``acc_out`` / ``acc_lse``'s rows ``target`` (one op);
    with ``dst_out`` / ``dst_lse``, the merged rows go to their rows ``dst_target`` instead."""
    torch.ops.megatron_ext.merge_rows_(acc_out, acc_lse, out, lse, source, target, dst_out, dst_lse, dst_target)


def _check(acc_out, acc_lse, out, lse, source, target, dst_out=None, dst_lse=None, dst_target=None) -> None:
    n = out.shape[0] if source is None else source.numel()
    targets = acc_out.shape[0] if target is None else target.numel()
    if targets != n:
        raise ValueError(f"merge_rows_: {n} source rows against {targets} target rows")
    if not acc_lse.dtype.is_floating_point or out.shape[1:] != acc_out.shape[1:] or lse.shape[1:] != acc_lse.shape[1:]:
        raise ValueError(f"merge_rows_: acc {tuple(acc_out.shape)} {acc_out.dtype} / {tuple(acc_lse.shape)} "
                         f"{acc_lse.dtype} against out {tuple(out.shape)} / lse {tuple(lse.shape)}")
    if (dst_out is None) != (dst_lse is None) or (dst_out is None and dst_target is not None):
        raise ValueError("merge_rows_: dst_out and dst_lse go together, and dst_target needs them")
    if dst_out is not None:
        dsts = dst_out.shape[0] if dst_target is None else dst_target.numel()
        if dsts != n or dst_out.shape[1:] != acc_out.shape[1:] or dst_lse.shape[1:] != acc_lse.shape[1:]:
            raise ValueError(f"merge_rows_: {n} merged rows of {tuple(acc_out.shape[1:])} against dst "
                             f"{tuple(dst_out.shape)} / {tuple(dst_lse.shape)} ({dsts} rows written)")


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
    def _merge_rows_kernel(acc_out, acc_lse, out, lse, source, target, dst_out, dst_lse, dst_target, H, D,
                           sa_n, sa_h, sa_d, sal_n, sal_h, so_n, so_h, so_d, sl_n, sl_h,
                           sd_n, sd_h, sd_d, sdl_n, sdl_h,
                           HAS_SOURCE: tl.constexpr, HAS_TARGET: tl.constexpr, HAS_DST_TARGET: tl.constexpr,
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
        if HAS_DST_TARGET:
            w_row = tl.load(dst_target + i).to(tl.int64)
        else:
            w_row = i.to(tl.int64)
        mh = h < H
        m = mh[:, None] & (d < D)[None, :]
        acc_t = acc_lse.dtype.element_ty  # the merge's dtype (float32; float64 in fp64 runs)
        lse_new = tl.load(lse + r * sl_n + h * sl_h, mask=mh, other=0.0).to(acc_t)  # [BH]
        lse_old = tl.load(acc_lse + t * sal_n + h * sal_h, mask=mh, other=0.0)
        top = tl.maximum(lse_old, lse_new)  # lse_new is finite, so top is
        merged = top + tl.log(tl.exp(lse_old - top) + tl.exp(lse_new - top))
        w = tl.exp(lse_new - merged)
        o_new = tl.load(out + r * so_n + h[:, None] * so_h + d[None, :] * so_d, mask=m, other=0.0).to(acc_t)
        o_old = tl.load(acc_out + t * sa_n + h[:, None] * sa_h + d[None, :] * sa_d, mask=m, other=0.0).to(acc_t)
        at = dst_out + w_row * sd_n + h[:, None] * sd_h + d[None, :] * sd_d
        tl.store(at, (o_old + w[:, None] * (o_new - o_old)).to(dst_out.dtype.element_ty), mask=m)
        tl.store(dst_lse + w_row * sdl_n + h * sdl_h, merged.to(dst_lse.dtype.element_ty), mask=mh)

    return _merge_rows_kernel


def _tile(H: int, D: int):
    """(heads, head dim) of a Triton program's tile over one row: the whole head dim, at most 4k elements."""
    import triton

    block_d = triton.next_power_of_2(D)
    return max(1, min(triton.next_power_of_2(H), 4096 // block_d)), block_d


def triton_merge_rows_(acc_out, acc_lse, out, lse, source=None, target=None, dst_out=None, dst_lse=None,
                       dst_target=None) -> None:
    """``merge_rows_`` through the Triton kernel (CUDA tensors, or CPU ones under TRITON_INTERPRET=1)."""
    import triton

    _check(acc_out, acc_lse, out, lse, source, target, dst_out, dst_lse, dst_target)
    if dst_out is None:  # in place: the rows read are the rows written
        dst_out, dst_lse, dst_target = acc_out, acc_lse, target
    n = out.shape[0] if source is None else source.numel()
    H, D = acc_out.shape[1], acc_out.shape[2]
    if n == 0:
        return
    block_h, block_d = _tile(H, D)
    dummy = acc_lse  # a pointer for an absent index (never read)
    _kernel()[(n, triton.cdiv(H, block_h))](
        acc_out, acc_lse, out, lse, dummy if source is None else source, dummy if target is None else target,
        dst_out, dst_lse, dummy if dst_target is None else dst_target,
        H, D, *acc_out.stride(), *acc_lse.stride(), *out.stride(), *lse.stride(), *dst_out.stride(),
        *dst_lse.stride(), HAS_SOURCE=source is not None, HAS_TARGET=target is not None,
        HAS_DST_TARGET=dst_target is not None, BLOCK_H=block_h, BLOCK_D=block_d)


def _merge_rows_cpu(acc_out, acc_lse, out, lse, source, target, dst_out=None, dst_lse=None, dst_target=None) -> None:
    _check(acc_out, acc_lse, out, lse, source, target, dst_out, dst_lse, dst_target)
    merge_rows_eager(acc_out, acc_lse, out, lse, source, target, dst_out, dst_lse, dst_target)


def _merge_rows_cuda(acc_out, acc_lse, out, lse, source, target, dst_out=None, dst_lse=None, dst_target=None) -> None:
    if not _triton_imports():
        _merge_rows_cpu(acc_out, acc_lse, out, lse, source, target, dst_out, dst_lse, dst_target)
    else:
        triton_merge_rows_(acc_out, acc_lse, out, lse, source, target, dst_out, dst_lse, dst_target)


def _merge_rows_meta(acc_out, acc_lse, out, lse, source, target, dst_out=None, dst_lse=None, dst_target=None) -> None:
    _check(acc_out, acc_lse, out, lse, source, target, dst_out, dst_lse, dst_target)


_LIB.impl("merge_rows_", _merge_rows_cpu, "CPU")
_LIB.impl("merge_rows_", _merge_rows_cuda, "CUDA")
_LIB.impl("merge_rows_", _merge_rows_meta, "Meta")


# Dtypes the Triton kernel adds into (atomically): the merge buffers' (float32; float64 in fp64 runs)
ATOMIC_DTYPES = (torch.float32, torch.float64)


def rows_into_eager(dst: torch.Tensor, src: torch.Tensor, source: Optional[torch.Tensor],
                    target: Optional[torch.Tensor], accumulate: bool) -> None:
    """``copy_rows_`` / ``add_rows_`` (``accumulate``) as torch ops: dst [N, H, D], src [n', H, D] (any
    float dtypes; a row is cast to dst's dtype, then added there), source / target [n] int64 rows of src /
    dst (None: rows 0..n-1, and then n = N for target)."""
    part = src if source is None else src.index_select(0, source)
    if target is None:  # every row of dst, in order: one in-place op, cast on the way
        if accumulate and torch.promote_types(part.dtype, dst.dtype) != dst.dtype:
            part = part.to(dst.dtype)  # added in dst's dtype, as index_add_ and the Triton kernel add
        (dst.add_ if accumulate else dst.copy_)(part)
    elif accumulate:
        dst.index_add_(0, target, part.to(dst.dtype))
    else:
        dst.index_copy_(0, target, part.to(dst.dtype))


def copy_rows_(dst: torch.Tensor, src: torch.Tensor, source: Optional[torch.Tensor] = None,
               target: Optional[torch.Tensor] = None) -> None:
    """``dst``'s rows ``target`` set to ``src``'s rows ``source``, cast to dst's dtype (one op)."""
    torch.ops.megatron_ext.copy_rows_(dst, src, source, target)


def add_rows_(dst: torch.Tensor, src: torch.Tensor, source: Optional[torch.Tensor] = None,
              target: Optional[torch.Tensor] = None) -> None:
    """``src``'s rows ``source`` added into ``dst``'s rows ``target``, in dst's dtype (one op; a target
    row named twice gets both)."""
    torch.ops.megatron_ext.add_rows_(dst, src, source, target)


def _name(accumulate: bool) -> str:
    return "add_rows_" if accumulate else "copy_rows_"


def _check_rows(dst, src, source, target, accumulate) -> None:
    n = src.shape[0] if source is None else source.numel()
    targets = dst.shape[0] if target is None else target.numel()
    if targets != n:
        raise ValueError(f"{_name(accumulate)}: {n} source rows against {targets} target rows")
    if dst.dim() != 3 or src.shape[1:] != dst.shape[1:]:
        raise ValueError(f"{_name(accumulate)}: dst {tuple(dst.shape)} against src {tuple(src.shape)}: [rows, H, D] "
                         f"each, the same H and D")


@functools.lru_cache(maxsize=None)
def _rows_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _rows_into_kernel(dst, src, source, target, H, D, sd_n, sd_h, sd_d, ss_n, ss_h, ss_d,
                          HAS_SOURCE: tl.constexpr, HAS_TARGET: tl.constexpr, ACCUMULATE: tl.constexpr,
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
        m = (h < H)[:, None] & (d < D)[None, :]
        value = tl.load(src + r * ss_n + h[:, None] * ss_h + d[None, :] * ss_d, mask=m, other=0.0)
        value = value.to(dst.dtype.element_ty)
        at = dst + t * sd_n + h[:, None] * sd_h + d[None, :] * sd_d
        if ACCUMULATE:
            tl.atomic_add(at, value, mask=m)  # a row named twice in target gets both
        else:
            tl.store(at, value, mask=m)

    return _rows_into_kernel


def triton_rows_into_(dst, src, source=None, target=None, accumulate=False) -> None:
    """``copy_rows_`` / ``add_rows_`` (``accumulate``) through the Triton kernel (CUDA tensors, or CPU ones
    under TRITON_INTERPRET=1); adds only into ``ATOMIC_DTYPES``."""
    import triton

    _check_rows(dst, src, source, target, accumulate)
    if accumulate and dst.dtype not in ATOMIC_DTYPES:
        raise ValueError(f"add_rows_: the Triton kernel adds into {ATOMIC_DTYPES}, not {dst.dtype}")
    n = src.shape[0] if source is None else source.numel()
    H, D = dst.shape[1], dst.shape[2]
    if n == 0:
        return
    block_h, block_d = _tile(H, D)
    dummy = dst  # a pointer for an absent index (never read)
    _rows_kernel()[(n, triton.cdiv(H, block_h))](
        dst, src, dummy if source is None else source, dummy if target is None else target, H, D,
        *dst.stride(), *src.stride(), HAS_SOURCE=source is not None, HAS_TARGET=target is not None,
        ACCUMULATE=accumulate, BLOCK_H=block_h, BLOCK_D=block_d)


def _rows_into_cpu(dst, src, source, target, accumulate) -> None:
    _check_rows(dst, src, source, target, accumulate)
    rows_into_eager(dst, src, source, target, accumulate)


def _rows_into_cuda(dst, src, source, target, accumulate) -> None:
    if not _triton_imports() or (accumulate and dst.dtype not in ATOMIC_DTYPES):
        _rows_into_cpu(dst, src, source, target, accumulate)
    else:
        triton_rows_into_(dst, src, source, target, accumulate)


def _rows_into_meta(dst, src, source, target, accumulate) -> None:
    _check_rows(dst, src, source, target, accumulate)


for _op, _accumulate in (("copy_rows_", False), ("add_rows_", True)):
    _LIB.impl(_op, functools.partial(_rows_into_cpu, accumulate=_accumulate), "CPU")
    _LIB.impl(_op, functools.partial(_rows_into_cuda, accumulate=_accumulate), "CUDA")
    _LIB.impl(_op, functools.partial(_rows_into_meta, accumulate=_accumulate), "Meta")


def sum_rows_eager(dst: torch.Tensor, src: torch.Tensor, source: torch.Tensor, offsets: torch.Tensor,
                   target: torch.Tensor) -> None:
    """``sum_rows_`` as torch ops: dst [N, H, D] (a float buffer), src [n', H, D] (any float dtype), source [n]
    int64 rows of src grouped by the dst row they add to (each row of src at most once), offsets [m + 1]
    int64 where each group starts (offsets[0] = 0, offsets[m] = n; each group ascending, as ``merge.RowSums``
    lists them), target [m] int64 each group's dst row: the rows cast to dst's dtype and added there in that
    order (``add_rows_``'s arithmetic over the rows ascending)."""
    index = torch.repeat_interleave(target, offsets[1:] - offsets[:-1])  # [n] each source row's dst row
    if source.numel() == src.shape[0]:
        # every row of src adds: where it lies, no gather (in row order: source's, where each group ascends);
        # a source that is not a permutation leaves a -1, which index_add_ refuses
        index = torch.full_like(index, -1).index_copy_(0, source, index)
        source = None
    rows_into_eager(dst, src, source, index, accumulate=True)


def sum_rows_(dst: torch.Tensor, src: torch.Tensor, source: torch.Tensor, offsets: torch.Tensor,
              target: torch.Tensor) -> None:
    """``dst``'s rows ``target[j]`` += the sum of ``src``'s rows ``source[offsets[j]:offsets[j + 1]]``, in dst's
    dtype (one op; each target row read and written once; ``source`` names a row of src at most once)."""
    torch.ops.megatron_ext.sum_rows_(dst, src, source, offsets, target)


def _check_sum_rows(dst, src, source, offsets, target) -> None:
    if (dst.dim() != 3 or src.shape[1:] != dst.shape[1:] or source.dim() != 1 or offsets.dim() != 1
            or target.dim() != 1 or offsets.numel() != target.numel() + 1
            or any(t.dtype != torch.long for t in (source, offsets, target))):
        raise ValueError(f"sum_rows_: dst {tuple(dst.shape)}, src {tuple(src.shape)}, source {tuple(source.shape)}, "
                         f"offsets {tuple(offsets.shape)} and target {tuple(target.shape)}: [N, H, D] and [n', H, D] "
                         f"of the same H and D, and int64 [n], [m + 1] and [m]")


@functools.lru_cache(maxsize=None)
def _sum_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _sum_rows_kernel(dst, src, source, offsets, target, H, D, sd_n, sd_h, sd_d, ss_n, ss_h, ss_d,
                         BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        j = tl.program_id(0)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
        d = tl.arange(0, BLOCK_D)  # [BD]
        m = (h < H)[:, None] & (d < D)[None, :]
        acc_t = dst.dtype.element_ty  # the buffer's dtype (float32; float64 in fp64 runs)
        total = tl.zeros([BLOCK_H, BLOCK_D], dtype=acc_t)
        for i in range(tl.load(offsets + j), tl.load(offsets + j + 1)):
            r = tl.load(source + i).to(tl.int64)
            total += tl.load(src + r * ss_n + h[:, None] * ss_h + d[None, :] * ss_d, mask=m, other=0.0).to(acc_t)
        t = tl.load(target + j).to(tl.int64)
        at = dst + t * sd_n + h[:, None] * sd_h + d[None, :] * sd_d
        tl.store(at, tl.load(at, mask=m, other=0.0) + total, mask=m)  # every target row is its own program's

    return _sum_rows_kernel


def triton_sum_rows_(dst, src, source, offsets, target) -> None:
    """``sum_rows_`` through the Triton kernel (CUDA tensors, or CPU ones under TRITON_INTERPRET=1); into
    ``ATOMIC_DTYPES`` only, as ``add_rows_``'s."""
    import triton

    _check_sum_rows(dst, src, source, offsets, target)
    if dst.dtype not in ATOMIC_DTYPES:
        raise ValueError(f"sum_rows_: the Triton kernel adds into {ATOMIC_DTYPES}, not {dst.dtype}")
    m, H, D = target.numel(), dst.shape[1], dst.shape[2]
    if m == 0:
        return
    block_h, block_d = _tile(H, D)
    _sum_kernel()[(m, triton.cdiv(H, block_h))](
        dst, src, source, offsets, target, H, D, *dst.stride(), *src.stride(), BLOCK_H=block_h, BLOCK_D=block_d)


def _sum_rows_cpu(dst, src, source, offsets, target) -> None:
    _check_sum_rows(dst, src, source, offsets, target)
    sum_rows_eager(dst, src, source, offsets, target)


def _sum_rows_cuda(dst, src, source, offsets, target) -> None:
    if not _triton_imports() or dst.dtype not in ATOMIC_DTYPES:
        _sum_rows_cpu(dst, src, source, offsets, target)
    else:
        triton_sum_rows_(dst, src, source, offsets, target)


_LIB.impl("sum_rows_", _sum_rows_cpu, "CPU")
_LIB.impl("sum_rows_", _sum_rows_cuda, "CUDA")
_LIB.impl("sum_rows_", _check_sum_rows, "Meta")


def gather_kv_rows_eager(dst: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor) -> None:
    """``gather_kv_rows_`` as torch ops: dst [n, C, Dk + Dv], k [L, C, Dk], v [L, C, Dv], index [n] int64 rows
    of k / v (any dims between the rows and the last one, alike in all three): each gathered straight into
    its half of dst."""
    dk = k.shape[-1]
    torch.index_select(k, 0, index, out=dst[..., :dk])
    torch.index_select(v, 0, index, out=dst[..., dk:])


def gather_kv_rows_(dst: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor) -> None:
    """``dst``'s rows are K and V of rows ``index``, side by side on the last dim (one op)."""
    torch.ops.megatron_ext.gather_kv_rows_(dst, k, v, index)


def _check_gather_kv(dst, k, v, index) -> None:
    if (dst.dim() != 3 or k.dim() != 3 or v.dim() != 3 or index.dim() != 1 or index.dtype != torch.long
            or dst.shape[0] != index.numel() or k.shape[:2] != v.shape[:2] or dst.shape[1] != k.shape[1]
            or dst.shape[2] != k.shape[2] + v.shape[2] or not (dst.dtype == k.dtype == v.dtype)):
        raise ValueError(f"gather_kv_rows_: dst {tuple(dst.shape)} {dst.dtype} against k {tuple(k.shape)} {k.dtype}, "
                         f"v {tuple(v.shape)} {v.dtype} and index {tuple(index.shape)} {index.dtype}: [n, C, Dk + Dv], "
                         f"[L, C, Dk], [L, C, Dv] of one dtype and n int64 rows")


@functools.lru_cache(maxsize=None)
def _gather_kv_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _gather_kv_kernel(dst, k, v, index, C, DK, DV, sd_n, sd_c, sd_d, sk_n, sk_c, sk_d, sv_n, sv_c, sv_d,
                          BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC]
        d = tl.arange(0, BLOCK_D)  # [BD]
        r = tl.load(index + i).to(tl.int64)
        row = dst + i * sd_n + c[:, None] * sd_c
        mk = (c < C)[:, None] & (d < DK)[None, :]
        tl.store(row + d[None, :] * sd_d, tl.load(k + r * sk_n + c[:, None] * sk_c + d[None, :] * sk_d, mask=mk),
                 mask=mk)
        mv = (c < C)[:, None] & (d < DV)[None, :]
        tl.store(row + (DK + d[None, :]) * sd_d,
                 tl.load(v + r * sv_n + c[:, None] * sv_c + d[None, :] * sv_d, mask=mv), mask=mv)

    return _gather_kv_kernel


def triton_gather_kv_rows_(dst, k, v, index) -> None:
    """``gather_kv_rows_`` through the Triton kernel (CUDA tensors, or CPU ones under TRITON_INTERPRET=1)."""
    import triton

    _check_gather_kv(dst, k, v, index)
    n, C = index.numel(), dst.shape[1]
    if n == 0:
        return
    block_c, block_d = _tile(C, max(k.shape[2], v.shape[2]))
    _gather_kv_kernel()[(n, triton.cdiv(C, block_c))](
        dst, k, v, index, C, k.shape[2], v.shape[2], *dst.stride(), *k.stride(), *v.stride(),
        BLOCK_C=block_c, BLOCK_D=block_d)


def _gather_kv_cpu(dst, k, v, index) -> None:
    _check_gather_kv(dst, k, v, index)
    gather_kv_rows_eager(dst, k, v, index)


def _gather_kv_cuda(dst, k, v, index) -> None:
    if not _triton_imports():
        _gather_kv_cpu(dst, k, v, index)
    else:
        triton_gather_kv_rows_(dst, k, v, index)


_LIB.impl("gather_kv_rows_", _gather_kv_cpu, "CPU")
_LIB.impl("gather_kv_rows_", _gather_kv_cuda, "CUDA")
_LIB.impl("gather_kv_rows_", _check_gather_kv, "Meta")

__all__ = ["ATOMIC_DTYPES", "add_rows_", "copy_rows_", "gather_kv_rows_", "gather_kv_rows_eager", "merge_rows_",
           "merge_rows_eager", "rows_into_eager", "sum_rows_", "sum_rows_eager", "triton_gather_kv_rows_",
           "triton_merge_rows_", "triton_rows_into_", "triton_sum_rows_"]
