"""The fused log-sum-exp merge (``blockdiag_cp.merge_kernel``): its eager body and its Triton kernel
against a float64 merge written from the definition (weights exp(lse_i) / sum exp(lse_j)), and the op as
one launch of the dispatcher.

The Triton kernel runs on CPU tensors under ``TRITON_INTERPRET=1``, in a fresh interpreter (the variable
must be set before Triton compiles anything).
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from megatron_ext.blockdiag_cp.merge_kernel import add_rows_, copy_rows_, merge_rows_, merge_rows_eager

# (rows of the buffer, heads, head dim, call output dtype, buffer dtype, lse dtype): the float32 buffer,
# or the result itself in bf16 / fp16 (a pair's second writer merges into the first's output)
SHAPES = [(7, 3, 5, torch.bfloat16, torch.float32, torch.float32), (9, 4, 8, torch.float32, torch.float32, torch.float32),
          (6, 2, 16, torch.float64, torch.float64, torch.float64), (5, 40, 130, torch.float16, torch.float32, torch.float32),
          (8, 3, 8, torch.bfloat16, torch.bfloat16, torch.float32), (6, 5, 12, torch.float16, torch.float16, torch.float32)]


def _case(seed, N, H, D, dtype, acc_dtype, lse_dtype, by_source, by_target):
    """A buffer with some rows not yet written (lse -inf), a call output read through strides (a padded
    head dim, lse transposed), and the rows to merge."""
    g = torch.Generator().manual_seed(seed)
    n = 4 if (by_source or by_target) else N
    acc_out = torch.randn(N, H, D, generator=g, dtype=torch.float64).to(acc_dtype)
    acc_lse = torch.randn(N, H, generator=g, dtype=torch.float64).to(lse_dtype)
    if acc_dtype == lse_dtype:  # a buffer row no call has merged into yet (the result's rows are written)
        acc_lse[0, : H // 2 + 1] = float("-inf")
    rows = n + 2 if by_source else n
    out = torch.randn(rows, H, D + 3, generator=g, dtype=torch.float64).to(dtype)[..., :D]
    lse = (3 * torch.randn(H, rows, generator=g, dtype=torch.float64)).to(lse_dtype).t()
    source = torch.randperm(rows, generator=g)[:n] if by_source else None
    target = torch.randperm(N, generator=g)[:n] if by_target else None
    if target is None:  # a run of the buffer: the op gets its view
        target_rows = torch.arange(n)
    else:
        target_rows = target
    return acc_out, acc_lse, out, lse, source, target, target_rows


def _reference(acc_out, acc_lse, out, lse, source, target_rows):
    """The merged rows from the definition, in float64."""
    o1, l1 = acc_out[target_rows].double(), acc_lse[target_rows].double()
    src = torch.arange(out.shape[0]) if source is None else source
    o2, l2 = out[src].double(), lse[src].double()
    top = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - top), torch.exp(l2 - top)
    merged_out = (w1.unsqueeze(-1) * o1 + w2.unsqueeze(-1) * o2) / (w1 + w2).unsqueeze(-1)
    return merged_out, top + torch.log(w1 + w2)


def _apply(fn, acc_out, acc_lse, out, lse, source, target, target_rows):
    a, b = acc_out.clone(), acc_lse.clone()
    if target is None:
        fn(a[: len(target_rows)], b[: len(target_rows)], out, lse, source, None)
    else:
        fn(a, b, out, lse, source, target)
    return a, b


def _check(name, got, case):
    acc_out, acc_lse, out, lse, source, target, target_rows = case
    want_out, want_lse = _reference(acc_out, acc_lse, out, lse, source, target_rows)
    a, b = got
    tol = {torch.float64: 1e-12, torch.float32: 2e-6}
    # a result in bf16 / fp16: rounded once (an ulp of the output dtype at most)
    out_tol = tol.get(a.dtype, 2 * torch.finfo(a.dtype).eps)
    torch.testing.assert_close(a[target_rows].double(), want_out, atol=out_tol, rtol=out_tol, msg=name)
    torch.testing.assert_close(b[target_rows].double(), want_lse, atol=tol[b.dtype], rtol=tol[b.dtype], msg=name)
    untouched = torch.ones(acc_out.shape[0], dtype=torch.bool)
    untouched[target_rows] = False
    assert torch.equal(a[untouched], acc_out[untouched]) and torch.equal(b[untouched], acc_lse[untouched]), name


def _apply_to(fn, acc_out, acc_lse, out, lse, source, target, target_rows, dst_dtype, by_dst):
    """The merge written into a fresh destination (rows ``dst_rows`` of it) with acc only read: (acc out, acc
    lse, dst out, dst lse, dst_rows); the destination's other rows keep their sentinel."""
    n = len(target_rows)
    dst_out = torch.full((n + 3,) + tuple(acc_out.shape[1:]), 7.0, dtype=dst_dtype)
    dst_lse = torch.full((n + 3, acc_lse.shape[1]), 7.0, dtype=acc_lse.dtype)
    dst_rows = torch.randperm(n + 3, generator=torch.Generator().manual_seed(n))[:n] if by_dst else torch.arange(n)
    a, b = acc_out.clone(), acc_lse.clone()
    if target is None:
        a_rows, b_rows = a[:n], b[:n]
    else:
        a_rows, b_rows = a, b
    if by_dst:
        fn(a_rows, b_rows, out, lse, source, target, dst_out, dst_lse, dst_rows)
    else:
        fn(a_rows, b_rows, out, lse, source, target, dst_out[:n], dst_lse[:n], None)
    return a, b, dst_out, dst_lse, dst_rows


def _check_to(name, fn, case, rounding_ulps=0):
    """Into another tensor: the buffer's rows untouched, the destination's merged rows the bits ``fn`` merges
    in place in the merge's dtype, rounded once into the destination's (by torch's rounding: Triton's own
    conversion may differ by ``rounding_ulps``), its other rows untouched."""
    acc_out, acc_lse, out, lse, source, target, target_rows = case
    in_place = _apply(fn, acc_out.to(acc_lse.dtype), *case[1:])
    for dst_dtype in {acc_out.dtype, acc_lse.dtype}:  # the result's dtype, or the float32 buffer's
        for by_dst in (False, True):
            a, b, dst_out, dst_lse, dst_rows = _apply_to(fn, *case, dst_dtype, by_dst)
            # acc_lse read only; acc_out's merged rows hold either what they held or the merged values
            # (the eager body merges a run of them in place on the way), the others untouched
            rest = torch.ones(acc_out.shape[0], dtype=torch.bool)
            rest[target_rows] = False
            assert torch.equal(b, acc_lse) and torch.equal(a[rest], acc_out[rest]), (name, "acc was written")
            kept = torch.equal(a[target_rows], acc_out[target_rows])
            assert kept or torch.equal(a[target_rows], in_place[0][target_rows].to(a.dtype)), (name, dst_dtype)
            want = in_place[0][target_rows].to(dst_dtype), in_place[1][target_rows]
            assert torch.equal(dst_lse[dst_rows], want[1]), (name, dst_dtype, by_dst)
            if dst_dtype == acc_lse.dtype or not rounding_ulps:
                assert torch.equal(dst_out[dst_rows], want[0]), (name, dst_dtype, by_dst)
            else:
                ulp = rounding_ulps * torch.finfo(dst_dtype).eps
                torch.testing.assert_close(dst_out[dst_rows].double(), in_place[0][target_rows].double(), atol=ulp,
                                           rtol=ulp, msg=f"{name} {dst_dtype} {by_dst}")
            rest = torch.ones(dst_out.shape[0], dtype=torch.bool)
            rest[dst_rows] = False
            assert bool((dst_out[rest] == 7).all()) and bool((dst_lse[rest] == 7).all()), (name, by_dst)


def _all_cases():
    for i, shape in enumerate(SHAPES):
        for by_source in (False, True):
            for by_target in (False, True):
                yield f"{shape} source={by_source} target={by_target}", _case(i, *shape, by_source, by_target)


def test_eager_merge_against_the_definition():
    for name, case in _all_cases():
        _check(name, _apply(merge_rows_eager, *case), case)


def test_merging_into_the_result_rounds_once_as_through_the_float32_buffer():
    """A pair's second writer merges into the first's bf16 output: the same bits as merging in a float32
    copy of it and rounding that once (what the float32 buffer and its write-back give)."""
    for name, case in _all_cases():
        acc_out, acc_lse, out, lse, source, target, target_rows = case
        if acc_out.dtype not in (torch.bfloat16, torch.float16):
            continue
        direct = _apply(merge_rows_eager, *case)
        through = _apply(merge_rows_eager, acc_out.float(), *case[1:])
        assert torch.equal(direct[0], through[0].to(acc_out.dtype)) and torch.equal(direct[1], through[1]), name


def test_merging_into_another_tensor_reads_acc_and_writes_the_in_place_bits_there():
    """``dst_out`` / ``dst_lse``: a second writer merging the first's output (the result) into the float32
    buffer, a last writer merging the buffer into the result, each the in-place merge's bits."""
    for name, case in _all_cases():
        _check_to(name, merge_rows_eager, case)
        _check_to(name, merge_rows_, case)


def test_a_destination_without_its_lse_or_of_other_rows_is_refused():
    acc_out, acc_lse, out, lse = torch.zeros(4, 2, 3), torch.zeros(4, 2), torch.zeros(4, 2, 3), torch.zeros(4, 2)
    with pytest.raises(ValueError, match="dst_out and dst_lse go together"):
        merge_rows_(acc_out, acc_lse, out, lse, None, None, torch.zeros(4, 2, 3))
    with pytest.raises(ValueError, match="4 merged rows"):
        merge_rows_(acc_out, acc_lse, out, lse, None, None, torch.zeros(5, 2, 3), torch.zeros(5, 2))


def test_the_op_is_one_launch_and_merges_as_the_eager_body():
    from megatron_ext.testing.op_counter import OpCounter

    counter = OpCounter()
    for name, case in _all_cases():
        with counter, counter.region(name):
            got = _apply(merge_rows_, *case)
        _check(name, got, case)
        # the clones, then the merge: one op whatever the rows (the eager body's 5-9 ops are not seen)
        assert dict(counter.counts[name].ops) == {"clone": 2, "merge_rows_": 1}, (name, counter.counts[name].ops)


def test_mismatched_rows_are_refused_with_both_counts():
    acc_out, acc_lse = torch.zeros(4, 2, 3), torch.zeros(4, 2)
    with pytest.raises(ValueError, match="3 source rows against 4 target rows"):
        merge_rows_(acc_out, acc_lse, torch.zeros(3, 2, 3), torch.zeros(3, 2))


def test_cuda_has_its_own_kernel_registered():
    for key in ("CPU", "CUDA", "Meta"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key("megatron_ext::merge_rows_", key), key


_INTERPRETED = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import test_merge_kernel as t
    from megatron_ext.blockdiag_cp import merge_kernel
    for name, case in t._all_cases():
        t._check(name, t._apply(merge_kernel.triton_merge_rows_, *case), case)
        # the CUDA registration's body: the Triton kernel where Triton imports
        t._check(name, t._apply(merge_kernel._merge_rows_cuda, *case), case)
        t._check_to(name, merge_kernel.triton_merge_rows_, case, rounding_ulps=1)  # into another tensor
    print("interpreted", len(list(t._all_cases())))
""")


def _interpreted(template: str) -> str:
    """``template`` (this directory formatted in as ``tests``) run under ``TRITON_INTERPRET=1`` in a fresh
    interpreter: its stdout, the run asserted clean."""
    pytest.importorskip("triton", reason="Triton is in the test extras (pip install -e '.[test]')")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = template.format(tests=os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.timeout(300)
def test_triton_kernel_under_the_interpreter_against_the_definition():
    assert f"interpreted {4 * len(SHAPES)}" in _interpreted(_INTERPRETED)


# copy_rows_ / add_rows_: (dst rows, heads, head dim, src dtype, dst dtype): bf16 gradients into the float32
# buffer, the buffer written back into a bf16 result, fp64 runs, a same-dtype scatter
ROW_SHAPES = [(9, 3, 5, torch.bfloat16, torch.float32), (7, 2, 8, torch.float32, torch.bfloat16),
              (6, 4, 16, torch.float64, torch.float64), (8, 40, 130, torch.float16, torch.float32),
              (5, 3, 8, torch.bfloat16, torch.bfloat16)]


def _rows_case(seed, N, H, D, src_dtype, dst_dtype, by_source, by_target, repeats):
    """A destination read through strides (one half of a [N, H, 2D] buffer, as dK of the fused dK / dV one),
    a source with a padded head dim, the rows moved (with ``repeats``, some target rows named twice)."""
    g = torch.Generator().manual_seed(seed)
    n = 4 if (by_source or by_target) else N
    dst = torch.randn(N, H, 2 * D, generator=g, dtype=torch.float64).to(dst_dtype)[..., :D]
    rows = n + 2 if by_source else n
    src = torch.randn(rows, H, D + 3, generator=g, dtype=torch.float64).to(src_dtype)[..., :D]
    source = torch.randperm(rows, generator=g)[:n] if by_source else None
    target = torch.randperm(N, generator=g)[:n] if by_target else None
    if target is not None and repeats:
        target[-1] = target[0]
    return dst, src, source, target


def _rows_reference(dst, src, source, target, accumulate):
    """Row by row in float64: each source row cast to dst's dtype, the sum rounded once into it."""
    want = dst.double().clone()
    n = src.shape[0] if source is None else source.numel()
    for i in range(n):
        r = i if source is None else int(source[i])
        t = i if target is None else int(target[i])
        want[t] = (want[t] if accumulate else 0) + src[r].to(dst.dtype).double()
    return want.to(dst.dtype)


def _rows_cases(accumulate):
    for i, shape in enumerate(ROW_SHAPES):
        for by_source in (False, True):
            for by_target in (False, True):
                for repeats in ((False, True) if accumulate and by_target else (False,)):
                    yield (f"{shape} source={by_source} target={by_target} repeats={repeats}",
                           _rows_case(i, *shape, by_source, by_target, repeats))


def _rows_check(name, fn, case, accumulate, rounding_ulps=0):
    dst, src, source, target = case
    got = dst.clone()
    n = src.shape[0] if source is None else source.numel()
    fn(got if target is not None else got[:n], src, source, target, accumulate)  # a run of dst: its view
    want = _rows_reference(dst, src, source, target, accumulate)
    if accumulate and target is not None and target.unique().numel() < target.numel():  # summed in some order
        tol = 2 * torch.finfo(dst.dtype).eps
        torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol, msg=name)
    elif rounding_ulps and dst.dtype.itemsize < src.dtype.itemsize:  # Triton's own rounding of the cast
        tol = rounding_ulps * torch.finfo(dst.dtype).eps
        torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol, msg=name)
    else:  # one rounding into dst's dtype, as torch's cast and index_add_ give
        assert torch.equal(got, want), name


@pytest.mark.parametrize("accumulate", [False, True])
def test_row_copies_and_adds_against_the_definition(accumulate):
    from megatron_ext.blockdiag_cp.merge_kernel import rows_into_eager

    op = add_rows_ if accumulate else copy_rows_
    for name, case in _rows_cases(accumulate):
        _rows_check(name, lambda d, s, r, t, a: op(d, s, r, t), case, accumulate)
        _rows_check(name, rows_into_eager, case, accumulate)


def test_row_ops_are_one_launch_each():
    from megatron_ext.testing.op_counter import OpCounter

    counter = OpCounter()
    for accumulate, op in ((False, copy_rows_), (True, add_rows_)):
        for name, (dst, src, source, target) in _rows_cases(accumulate):
            n = src.shape[0] if source is None else source.numel()
            with counter, counter.region((accumulate, name)):
                op(dst.clone()[: dst.shape[0] if target is not None else n], src, source, target)
            # the clone, then the op: one whatever the rows and dtypes (the eager body's gather, cast and
            # scatter are not seen)
            assert dict(counter.counts[(accumulate, name)].ops) == {"clone": 1, op.__name__: 1}, name


def test_row_ops_refuse_mismatched_rows_and_shapes():
    with pytest.raises(ValueError, match="add_rows_: 3 source rows against 4 target rows"):
        add_rows_(torch.zeros(4, 2, 3), torch.zeros(3, 2, 3))
    with pytest.raises(ValueError, match=r"copy_rows_: dst \(4, 2, 3\) against src \(4, 3, 3\)"):
        copy_rows_(torch.zeros(4, 2, 3), torch.zeros(4, 3, 3))
    for key in ("CPU", "CUDA", "Meta"):
        for op in ("copy_rows_", "add_rows_"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"megatron_ext::{op}", key), (op, key)


def test_the_triton_row_kernel_adds_only_into_float32_or_float64():
    from megatron_ext.blockdiag_cp.merge_kernel import triton_rows_into_

    pytest.importorskip("triton", reason="Triton is in the test extras (pip install -e '.[test]')")
    with pytest.raises(ValueError, match="adds into .* not torch.bfloat16"):
        triton_rows_into_(torch.zeros(4, 2, 3, dtype=torch.bfloat16), torch.zeros(4, 2, 3), accumulate=True)


_ROWS_INTERPRETED = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import test_merge_kernel as t
    from megatron_ext.blockdiag_cp import merge_kernel
    count = 0
    for accumulate in (False, True):
        for name, case in t._rows_cases(accumulate):
            if accumulate and case[0].dtype not in merge_kernel.ATOMIC_DTYPES:
                continue  # the CUDA registration takes the eager body there
            t._rows_check(name, merge_kernel.triton_rows_into_, case, accumulate, rounding_ulps=1)
            t._rows_check(name, merge_kernel._rows_into_cuda, case, accumulate, rounding_ulps=1)
            count += 1
    print("interpreted", count)
""")


@pytest.mark.timeout(300)
def test_triton_row_kernel_under_the_interpreter_against_the_definition():
    stdout = _interpreted(_ROWS_INTERPRETED)
    expected = sum(1 for _ in _rows_cases(False)) + sum(
        1 for _, case in _rows_cases(True) if case[0].dtype in (torch.float32, torch.float64))
    assert f"interpreted {expected}" in stdout, stdout


def _sum_cases():
    """``sum_rows_`` over a strided half of a fused [N, H, 2D] buffer (dK's of the fused dK / dV one), from a
    source with a padded head dim: every source row arriving (the eager body adds them where they lie) or
    some, several arrivals a buffer row, one row arriving alone, and none at all; the rows grouped as
    ``merge.RowSums.of`` groups them."""
    from megatron_ext.blockdiag_cp.merge import RowSums

    for seed, (N, H, D, src_dtype, dst_dtype) in enumerate(ROW_SHAPES[:4]):
        g = torch.Generator().manual_seed(seed)
        dst = torch.randn(N, H, 2 * D, generator=g, dtype=torch.float64).to(dst_dtype)[..., :D]
        src = torch.randn(11, H, D + 3, generator=g, dtype=torch.float64).to(src_dtype)[..., :D]
        for n in (11, 9, 0):
            rows = torch.randperm(11, generator=g)[:n]  # the arrival rows that add into the buffer
            slots = torch.randint(0, 3, (n,), generator=g) * 2  # three buffer rows, each named several times
            if n:
                slots[0] = N - 1  # and one named once
            sums = RowSums.of(rows.numpy(), slots.numpy(), "cpu") if n else RowSums(*(
                torch.zeros(k, dtype=torch.long) for k in (0, 1, 0)))
            yield f"{(N, H, D, src_dtype, dst_dtype, n)}", (dst, src, rows, slots, sums)


def _sum_check(name, op, case, tol_ulps=0):
    """Against the definition (each arrival cast to dst's dtype, the sum in float64) within ``tol_ulps`` of dst's
    dtype a term; without, ``add_rows_``'s bits for the same arrivals (added one by one, rows ascending)."""
    dst, src, rows, slots, sums = case
    got = dst.clone()
    op(got, src, sums.source, sums.offsets, sums.target)
    if tol_ulps:  # summed first, then added: another order of the same sum
        want = _rows_reference(dst, src, rows, slots, accumulate=True)
        tol = tol_ulps * torch.finfo(dst.dtype).eps
        torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol, msg=name)
        return
    want, ascending = dst.clone(), torch.argsort(rows)
    if rows.numel():
        add_rows_(want, src, rows[ascending], slots[ascending])
    assert torch.equal(got, want), name


def test_row_sums_add_each_buffer_rows_arrivals_in_one_op():
    """``sum_rows_`` (eager on CPU) gives ``add_rows_``'s bits for the same arrivals: ``RowSums.of`` lists a
    row's arrivals ascending; one launch; refused shapes; a grouping only where a row repeats."""
    from megatron_ext.blockdiag_cp.merge import RowSums
    from megatron_ext.blockdiag_cp.merge_kernel import sum_rows_, sum_rows_eager
    from megatron_ext.testing.op_counter import OpCounter

    for name, case in _sum_cases():
        for op in (sum_rows_, sum_rows_eager):
            _sum_check(name, op, case)
            _sum_check(name, op, case, tol_ulps=4)
    dst, src, rows, slots, sums = next(iter(_sum_cases()))[1]
    counter = OpCounter()
    with counter, counter.region("sum"):
        sum_rows_(dst.clone(), src, sums.source, sums.offsets, sums.target)
    assert dict(counter.counts["sum"].ops) == {"clone": 1, "sum_rows_": 1}
    assert RowSums.of(np.array([3, 1]), np.array([4, 0]), "cpu") is None  # no repeat: one add_rows_ moves as much
    drawn = RowSums.of(np.arange(6), np.array([7, 2, 7, 9, 2, 7]), "cpu")  # the class docstring's drawing
    assert (drawn.source.tolist(), drawn.offsets.tolist(), drawn.target.tolist()) == (
        [1, 4, 0, 2, 5, 3], [0, 2, 5, 6], [2, 7, 9])
    with pytest.raises(ValueError, match=r"sum_rows_: dst \(4, 2, 3\), src \(3, 3, 3\)"):
        sum_rows_(torch.zeros(4, 2, 3), torch.zeros(3, 3, 3), sums.source, sums.offsets, sums.target)
    with pytest.raises(RuntimeError, match="out of bounds"):  # a source that names one row twice and one never
        sum_rows_(torch.zeros(4, 2, 3), torch.zeros(3, 2, 3), torch.tensor([0, 0, 1]), torch.tensor([0, 2, 3]),
                  torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"offsets \(3,\) and target \(3,\)"):
        sum_rows_(torch.zeros(4, 2, 3), torch.zeros(3, 2, 3), torch.arange(3), torch.arange(3), torch.arange(3))
    for key in ("CPU", "CUDA", "Meta"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key("megatron_ext::sum_rows_", key), key


_SUM_INTERPRETED = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import test_merge_kernel as t
    from megatron_ext.blockdiag_cp import merge_kernel
    count = 0
    for name, case in t._sum_cases():
        if case[0].dtype not in merge_kernel.ATOMIC_DTYPES:
            continue  # the CUDA registration takes the eager body there
        t._sum_check(name, merge_kernel.triton_sum_rows_, case, tol_ulps=4)
        t._sum_check(name, merge_kernel._sum_rows_cuda, case, tol_ulps=4)  # the CUDA registration's body
        count += 1
    print("interpreted", count)
""")


@pytest.mark.timeout(300)
def test_triton_row_sums_under_the_interpreter_against_the_definition():
    expected = sum(1 for _, case in _sum_cases() if case[0].dtype in (torch.float32, torch.float64))
    assert f"interpreted {expected}" in _interpreted(_SUM_INTERPRETED)


# gather_kv_rows_: (local rows, batch x heads, Dk, Dv, dtype): GQA bf16, MLA's wider keys, fp64, a batch of two
KV_SHAPES = [(12, 2, 8, 8, torch.bfloat16), (9, 3, 12, 8, torch.bfloat16), (10, 4, 16, 16, torch.float64),
             (11, 6, 5, 7, torch.float32)]


def _kv_cases():
    """K and V read through strides (halves of one [L, C, Dk + Dv] projection, as Megatron's fused QKV gives
    them), rows gathered out of order with one repeated, and no row."""
    for seed, (L, C, Dk, Dv, dtype) in enumerate(KV_SHAPES):
        g = torch.Generator().manual_seed(seed)
        kv = torch.randn(L, C, Dk + Dv + 2, generator=g, dtype=torch.float64).to(dtype)
        k, v = kv[..., :Dk], kv[..., Dk + 2:]
        for n in (5, 0):
            index = torch.randperm(L, generator=g)[:n]
            if n:
                index[-1] = index[0]
            yield f"{(L, C, Dk, Dv, dtype, n)}", (k, v, index)


def _kv_check(name, op, case):
    k, v, index = case
    dst = torch.full((index.numel(), k.shape[1], k.shape[2] + v.shape[2]), float("nan"), dtype=k.dtype)
    op(dst, k, v, index)
    want = torch.cat([k[index], v[index]], dim=-1)  # the definition: rows gathered, K then V
    assert torch.equal(dst, want), name


def test_gather_kv_rows_is_k_and_v_side_by_side_in_one_op():
    from megatron_ext.blockdiag_cp.merge_kernel import gather_kv_rows_
    from megatron_ext.testing.op_counter import OpCounter

    for name, case in _kv_cases():
        _kv_check(name, gather_kv_rows_, case)
    k, v, index = next(iter(_kv_cases()))[1]
    counter = OpCounter()
    dst = torch.empty(index.numel(), k.shape[1], k.shape[2] + v.shape[2], dtype=k.dtype)
    with counter, counter.region("gather"):
        gather_kv_rows_(dst, k, v, index)
    assert dict(counter.counts["gather"].ops) == {"gather_kv_rows_": 1}
    with pytest.raises(ValueError, match=r"gather_kv_rows_: dst \(5, 2, 15\)"):
        gather_kv_rows_(torch.empty(5, 2, 15, dtype=k.dtype), k, v, index)  # Dk + Dv is 16
    with pytest.raises(ValueError, match="of one dtype"):
        gather_kv_rows_(dst.float(), k, v, index)
    for key in ("CPU", "CUDA", "Meta"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key("megatron_ext::gather_kv_rows_", key), key


_KV_INTERPRETED = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import test_merge_kernel as t
    from megatron_ext.blockdiag_cp import merge_kernel
    count = 0
    for name, case in t._kv_cases():
        t._kv_check(name, merge_kernel.triton_gather_kv_rows_, case)
        t._kv_check(name, merge_kernel._gather_kv_cuda, case)  # the CUDA registration's body
        count += 1
    print("interpreted", count)
""")


@pytest.mark.timeout(300)
def test_triton_kv_gather_under_the_interpreter_against_the_definition():
    assert f"interpreted {2 * len(KV_SHAPES)}" in _interpreted(_KV_INTERPRETED)
