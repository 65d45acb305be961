"""Misuse real training code hits: never a silent wrong result, never a hang.

Every multi-rank case runs on gloo with a timeout and asserts the error on every
rank, followed by a barrier that proves no rank is left inside a collective.
"""

import threading

import pytest
import torch

from megatron_ext.testing import catch, pool_fixture
from megatron_ext.testing.reference import reference_attention

GOOD = torch.tensor([1] * 5 + [2] * 7 + [3] * 4 + [0] * 2 + [4] * 6)  # S = 24


pool2 = pool_fixture(2)


pool3 = pool_fixture(3)


def _qkv(S, seed, b=1, hq=4, hkv=2, d=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(S, b, h, d, generator=g, dtype=dtype) for h in (hq, hkv, hkv)]


def _local(state, full):
    return state.shard(full, seq_dim=0).detach().requires_grad_(True)


# ---------------------------------------------------------------------------
# 1. a second backward through a retained graph accumulates, like any torch op
# ---------------------------------------------------------------------------


def second_backward_accumulates(exchanges):
    import torch.distributed as dist

    import megatron_ext.blockdiag_cp as bdcp

    group = dist.group.WORLD if dist.is_initialized() else None
    out = {}
    for exchange in exchanges:
        state = bdcp.BlockDiagCPState.build(GOOD, cp_group=group, layout="contiguous",
                                            attn_backend="dense", kv_exchange=exchange)
        q, k, v = (_local(state, t) for t in _qkv(GOOD.numel(), seed=3))
        w = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(4))
        with bdcp.blockdiag_cp_step(state):
            loss = (bdcp.blockdiag_cp_attention(q, k, v) * w).sum()
            loss.backward(retain_graph=True)
            once = [t.grad.clone() for t in (q, k, v)]
            loss.backward()
            twice = [t.grad.clone() for t in (q, k, v)]
            # autograd.grad(retain_graph=True) then backward() on a fresh graph: the same gradients.
            for t in (q, k, v):
                t.grad = None
            loss = (bdcp.blockdiag_cp_attention(q, k, v) * w).sum()
            grads = torch.autograd.grad(loss, [q, k, v], retain_graph=True)
            loss.backward()
        out[exchange] = (max(float((b - 2 * a).abs().max()) for a, b in zip(once, twice)),
                         max(float((g - t.grad).abs().max()) for g, t in zip(grads, (q, k, v))),
                         max(float(a.abs().max()) for a in once))
    return out


def test_second_backward_accumulates_at_cp1():
    for exchange, (err2, err_grad, scale) in second_backward_accumulates(["allgather"]).items():
        assert scale > 0 and err2 < 1e-12 and err_grad < 1e-12, (exchange, err2, err_grad)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("pool_name", ["pool2", "pool3"])
def test_second_backward_accumulates_with_cp(request, pool_name):
    results = request.getfixturevalue(pool_name).run(second_backward_accumulates,
                                                     ["allgather", "halo", "a2a"])
    for per_rank in results:
        for exchange, (err2, err_grad, scale) in per_rank.items():
            assert err2 < 1e-12 and err_grad < 1e-12, (pool_name, exchange, err2, err_grad)


# ---------------------------------------------------------------------------
# 2. mask types other than causal are refused at construction
# ---------------------------------------------------------------------------


def test_non_causal_mask_types_and_cross_attention_are_refused():
    from megatron.core.transformer.enums import AttnMaskType

    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.testing.gpt import config
    from megatron_ext.layers import BlockDiagCPAttention

    cfg = config(cp=1)
    for mask_type in (AttnMaskType.no_mask, AttnMaskType.padding, AttnMaskType.arbitrary):
        with pytest.raises(bdcp.BlockDiagCPError, match="supported: causal, padding_causal"):
            BlockDiagCPAttention(cfg, 1, mask_type, "self")
    with pytest.raises(bdcp.BlockDiagCPError, match="self-attention only"):
        BlockDiagCPAttention(cfg, 1, AttnMaskType.causal, "cross")
    layer = BlockDiagCPAttention(cfg, 1, AttnMaskType.padding_causal, "self")
    q = torch.randn(8, 1, 4, 8)
    with pytest.raises(bdcp.BlockDiagCPError, match="not supported"):
        layer(q, q, q, None, attn_mask_type=AttnMaskType.no_mask)


# ---------------------------------------------------------------------------
# 3, 4. knobs and doc ids agreed across ranks
# ---------------------------------------------------------------------------


def build_per_rank(kwargs_per_rank, ids_per_rank=None):
    import torch.distributed as dist

    import megatron_ext.blockdiag_cp as bdcp

    rank = dist.get_rank()
    ids = GOOD if ids_per_rank is None else ids_per_rank[rank]
    err = catch(lambda: bdcp.BlockDiagCPState.build(ids, **kwargs_per_rank[rank]))
    dist.barrier()
    return err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("knob,values,needle", [
    ("layout", ["contiguous", "zigzag"], "layout ('contiguous' vs 'zigzag')"),
    ("layout", ["balanced", "zigzag"], "layout ('balanced' vs 'zigzag')"),  # only one has a cost model
    ("kv_exchange", ["halo", "a2a"], "kv_exchange ('a2a' vs 'halo')"),
    ("attn_backend", ["dense", "te"], "attn_backend"),
    ("strict", [False, True], "strict"),
    ("kv_backward", ["refetch", "save"], "kv_backward ('refetch' vs 'save')"),
])
def test_knobs_that_differ_across_ranks_raise_on_every_rank(pool2, knob, values, needle):
    kwargs = [{"attn_backend": "dense", knob: value} for value in values]
    for err in pool2.run(build_per_rank, kwargs):
        assert err is not None and err[0] == "BlockDiagCPError", err
        assert "differ across the CP ranks" in err[1] and needle in err[1], err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("models", ["links", "hierarchy", "nodes"])
def test_balanced_cost_models_that_differ_raise_on_every_rank(pool2, models):
    from megatron_ext.blockdiag_cp import CostModel

    pair = {"links": (CostModel.preset("nvlink"), CostModel.preset("ib")),
            "hierarchy": (CostModel.two_level(1), CostModel.two_level(1, hierarchical=False)),
            "nodes": (CostModel.two_level(1), CostModel.two_level(2))}[models]
    kwargs = [{"attn_backend": "dense", "layout": "balanced", "cost_model": cm} for cm in pair]
    for err in pool2.run(build_per_rank, kwargs):
        assert err is not None and "cost model differs across the CP ranks" in err[1], err


@pytest.mark.timeout(120)
def test_a_bad_knob_on_one_rank_raises_on_every_rank(pool2):
    errs = pool2.run(build_per_rank, [{"kv_exchange": "ring"}, {"kv_exchange": "a2a"}])
    assert "'ring'" in errs[0][1] and "another CP rank (CP rank 0)" in errs[1][1], errs


@pytest.mark.timeout(120)
def test_checksum_colliding_doc_ids_are_caught(pool2):
    # These two collide on the old position-weighted sums; the run-length fingerprint tells them apart.
    a = torch.tensor([0, 1, 1, 0] + [5] * 12)
    b = torch.tensor([1, 0, 0, 1] + [5] * 12)
    for err in pool2.run(build_per_rank, [{"attn_backend": "dense"}] * 2, [a, b]):
        assert err is not None and "doc_ids differ across the CP ranks" in err[1], err


def test_fingerprint_separates_simple_patterns():
    from megatron_ext.blockdiag_cp.agreement import doc_ids_fingerprint

    # Every id sequence of length 4 over {0, 1, 2}: all 81 fingerprints distinct.
    import itertools
    seqs = [torch.tensor(s).view(1, -1) for s in itertools.product(range(3), repeat=4)]
    prints = {doc_ids_fingerprint(s) for s in seqs}
    assert len(prints) == len(seqs)
    # Equal runs give equal fingerprints (it is a function of the run-length encoding only).
    assert doc_ids_fingerprint(torch.tensor([[7, 7, 2]])) == doc_ids_fingerprint(torch.tensor([[7, 7, 2]]))
    assert doc_ids_fingerprint(torch.tensor([[1, 1, 2]])) != doc_ids_fingerprint(torch.tensor([[1, 2, 2]]))


# ---------------------------------------------------------------------------
# 5. a kernel failure with an explicit state and no step context is raised
# ---------------------------------------------------------------------------


def failure_outside_a_step(fail_on_rank, backend_name="dense"):
    import torch.distributed as dist

    import contextlib

    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.testing import override_kernel

    rank = dist.get_rank()
    state = bdcp.BlockDiagCPState.build(GOOD, attn_backend="dense", kv_exchange="a2a")
    q, k, v = (_local(state, t) for t in _qkv(GOOD.numel(), seed=5))

    def broken(*args, **kw):
        raise RuntimeError("injected kernel failure")

    from megatron_ext.blockdiag_cp.kernels import Kernel

    with override_kernel("dense", Kernel(broken, broken)) if rank == fail_on_rank else contextlib.nullcontext():
        out = bdcp.blockdiag_cp_attention(q, k, v, state=state)  # explicit state, no step context
        out.sum().backward()
    zeros = bool((out == 0).all())
    err = catch(lambda: bdcp.BlockDiagCPState.build(GOOD, attn_backend="dense"))
    again = catch(lambda: bdcp.BlockDiagCPState.build(GOOD, attn_backend="dense"))  # raised once
    dist.barrier()
    return zeros, err, again


@pytest.mark.timeout(120)
def test_kernel_failure_outside_a_step_is_raised_at_the_next_build_on_every_rank(pool2):
    results = pool2.run(failure_outside_a_step, 0)
    assert results[0][0] and not results[1][0]  # rank 0's output was the zeros placeholder
    for zeros, err, again in results:
        assert err is not None and err[0] == "BlockDiagCPError", err
        assert "kernel failed" in err[1] and "at least one CP rank" in err[1], err
        assert again is None  # the failure was raised once, then cleared
    assert "injected kernel failure" in results[0][1][1]
    # The dense kernel itself failed: the advice must not be "use dense".
    assert "rerun with --cp-attn-backend dense" not in results[0][1][1]
    assert "no other backend is left" in results[0][1][1]


# ---------------------------------------------------------------------------
# 6. two threads
# ---------------------------------------------------------------------------


def test_concurrent_build_on_one_group_is_refused():
    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.blockdiag_cp.agreement import BUILD_GUARD, group_ranks

    ranks = group_ranks(None)
    box = {}
    BUILD_GUARD.enter(ranks)  # another thread is in the middle of a build
    try:
        t = threading.Thread(target=lambda: box.setdefault("err", catch(lambda: bdcp.BlockDiagCPState.build(GOOD))))
        t.start()
        t.join()
    finally:
        BUILD_GUARD.exit(ranks)
    assert box["err"][0] == "BlockDiagCPError" and "two threads" in box["err"][1]
    assert bdcp.BlockDiagCPState.build(GOOD).cp == 1  # free again afterwards


def test_a_step_from_a_second_thread_while_one_is_open_is_refused():
    import megatron_ext.blockdiag_cp as bdcp

    state_a = bdcp.BlockDiagCPState.build(GOOD, attn_backend="dense")
    state_b = bdcp.BlockDiagCPState.build(GOOD, attn_backend="dense")
    box = {}

    def other_thread():
        with pytest.raises(bdcp.BlockDiagCPError, match="second thread") as err:
            with bdcp.blockdiag_cp_step(state_b):
                pass
        box["ok"] = err is not None

    with bdcp.blockdiag_cp_step(state_a):
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
    assert box.get("ok")


def test_a_step_nested_in_another_steps_context_is_refused():
    import megatron_ext.blockdiag_cp as bdcp

    outer = bdcp.BlockDiagCPState.build(GOOD, attn_backend="dense")
    inner = bdcp.BlockDiagCPState.build(torch.ones(GOOD.numel(), dtype=torch.long), attn_backend="dense")
    with pytest.raises(bdcp.BlockDiagCPError, match="inside another step's context"):
        with bdcp.blockdiag_cp_step(outer):
            with bdcp.blockdiag_cp_step(inner):  # would silently attend over inner's documents
                pass
    with bdcp.blockdiag_cp_step(outer):  # the refused nesting left nothing published
        assert bdcp.state.current_blockdiag_state() is outer
    assert bdcp.state.current_blockdiag_state() is None


def test_a_build_from_a_second_thread_while_a_step_is_open_is_refused():
    import megatron_ext.blockdiag_cp as bdcp

    state = bdcp.BlockDiagCPState.build(GOOD, attn_backend="dense")
    box = {}
    with bdcp.blockdiag_cp_step(state):
        t = threading.Thread(target=lambda: box.setdefault(
            "err", catch(lambda: bdcp.BlockDiagCPState.build(GOOD, attn_backend="dense"))))
        t.start()
        t.join()
        assert bdcp.BlockDiagCPState.build(GOOD, attn_backend="dense").cp == 1  # the step's own thread may
    assert box["err"] is not None and box["err"][0] == "BlockDiagCPError", box
    assert "second thread" in box["err"][1] and "step is open" in box["err"][1], box


# ---------------------------------------------------------------------------
# 7, 8. per-rank shape, head or dtype mismatch: BlockDiagCPError on every rank, no hang
# ---------------------------------------------------------------------------


def mismatch_on_rank0(kind):
    import time

    import torch.distributed as dist

    import megatron_ext.blockdiag_cp as bdcp

    rank = dist.get_rank()
    state = bdcp.BlockDiagCPState.build(GOOD, attn_backend="dense", kv_exchange="allgather")
    L = state.local_len
    shapes = {"short_q": ((L - 1, 1, 4, 8), (L, 1, 2, 8)), "heads": ((L, 1, 2, 8), (L, 1, 1, 8))}
    dtype = torch.float32
    q_shape, kv_shape = (L, 1, 4, 8), (L, 1, 2, 8)
    if rank == 0:
        if kind == "dtype":
            dtype = torch.float64
        else:
            q_shape, kv_shape = shapes[kind]
    q = torch.randn(q_shape, dtype=dtype)
    k, v = torch.randn(kv_shape, dtype=dtype), torch.randn(kv_shape, dtype=dtype)
    start = time.perf_counter()
    with_step = catch(lambda: _run_in_step(bdcp, state, q, k, v))
    dist.barrier()
    return with_step, time.perf_counter() - start


def _run_in_step(bdcp, state, q, k, v):
    with bdcp.blockdiag_cp_step(state):
        bdcp.blockdiag_cp_attention(q, k, v)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind,needles", [
    ("short_q", ["local_len", "CP rank 0's own error gives the value"]),
    ("heads", ["differ across the CP ranks", "q_heads 2 vs 4"]),
    ("dtype", ["differ across the CP ranks", "dtype"]),
])
def test_per_rank_qkv_mismatch_raises_on_every_rank_without_a_hang(pool2, kind, needles):
    results = pool2.run(mismatch_on_rank0, kind)
    for rank, (err, seconds) in enumerate(results):
        assert err is not None and err[0] == "BlockDiagCPError", (rank, err)
        assert seconds < 30, seconds
    if kind == "short_q":
        assert needles[0] in results[0][0][1] and needles[1] in results[1][0][1]
    else:
        for err, _ in results:
            assert all(n in err[1] for n in needles), err


def qkv_agreement_cost(reps):
    import time

    import torch.distributed as dist

    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.blockdiag_cp.attention_op import agree_on_qkv

    state = bdcp.BlockDiagCPState.build(GOOD, attn_backend="dense")
    q = torch.randn(state.local_len, 1, 4, 8)
    k = torch.randn(state.local_len, 1, 2, 8)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        agree_on_qkv(state, q, k, k, None)
    return (time.perf_counter() - start) / reps


@pytest.mark.timeout(120)
def test_qkv_agreement_is_one_small_collective(pool2):
    # Not a timing assertion (benchmarks own those): it runs, and costs well under a second per call.
    per_call = pool2.run(qkv_agreement_cost, 20)
    assert all(0 < t < 1.0 for t in per_call), per_call


def agreements_per_step(every_call, layers=4):
    """All-reduces issued by ``layers`` attention calls of one step (K/V moves point to point)."""
    import os

    import torch.distributed as dist

    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.blockdiag_cp.attention_op import CHECK_EVERY_CALL_ENV

    state = bdcp.BlockDiagCPState.build(GOOD, attn_backend="dense", kv_exchange="a2a")
    q, k, v = (_local(state, t) for t in _qkv(GOOD.numel(), seed=3))
    calls = []
    real = dist.all_reduce

    def counted(*args, **kwargs):
        calls.append(args[0].numel())
        return real(*args, **kwargs)

    os.environ[CHECK_EVERY_CALL_ENV] = "1" if every_call else ""
    dist.all_reduce = counted
    try:
        with bdcp.blockdiag_cp_step(state):
            outs = [bdcp.blockdiag_cp_attention(q, k, v) for _ in range(layers)]
            sum(o.sum() for o in outs).backward()
    finally:
        dist.all_reduce = real
        os.environ.pop(CHECK_EVERY_CALL_ENV)
    return calls


@pytest.mark.timeout(120)
def test_qkv_agreement_runs_once_per_step_unless_every_call_is_asked(pool2):
    from megatron_ext.blockdiag_cp.agreement import AGREEMENT_WORDS

    for calls in pool2.run(agreements_per_step, False):
        # One q/k/v agreement on the first layer, one failure check at the step's end; every agreement
        # is one fixed-size vector.
        assert calls == [AGREEMENT_WORDS] * 2, calls
    for calls in pool2.run(agreements_per_step, True):
        assert calls == [AGREEMENT_WORDS] * 5, calls


# ---------------------------------------------------------------------------
# 9. uint64 doc ids
# ---------------------------------------------------------------------------


def test_unsigned_doc_ids_work_or_get_our_message():
    import megatron_ext.blockdiag_cp as bdcp

    plain = bdcp.BlockDiagCPState.build(GOOD, attn_backend="dense")
    for dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64):
        state = bdcp.BlockDiagCPState.build(GOOD.to(dtype), attn_backend="dense")
        assert torch.equal(state.doc_ids, plain.doc_ids), dtype
    huge = torch.tensor([1, 2], dtype=torch.uint64) * (2 ** 62) * 3  # above 2**63 - 1
    with pytest.raises(bdcp.BlockDiagCPError, match="doc_ids must be >= 0 .*unsigned id above 2\\*\\*63"):
        bdcp.BlockDiagCPState.build(huge)


# ---------------------------------------------------------------------------
# 10. non-reentrant checkpoint runs the attention (and its collectives) twice, not three times
# ---------------------------------------------------------------------------


def fires_under_checkpoint(use_reentrant):
    import torch.distributed as dist
    from torch.utils.checkpoint import checkpoint

    import megatron_ext.blockdiag_cp as bdcp

    group = dist.group.WORLD if dist.is_initialized() else None
    state = bdcp.BlockDiagCPState.build(GOOD, cp_group=group, attn_backend="dense", kv_exchange="a2a")
    full = _qkv(GOOD.numel(), seed=9)
    q, k, v = (_local(state, t) for t in full)
    w = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(10))
    bdcp.reset_cp_attn_fire_count()
    with bdcp.blockdiag_cp_step(state):
        out = checkpoint(lambda a, b, c: bdcp.blockdiag_cp_attention(a, b, c), q, k, v,
                         use_reentrant=use_reentrant)
        (out * w).sum().backward()
    fires = bdcp.cp_attn_fire_count()
    # Against the independent reference on the full sequence.
    ref_in = [t.detach().requires_grad_(True) for t in full]
    ref = reference_attention(*ref_in, GOOD)
    pos = state.local_positions  # S = 24 needs no padding at cp 1 or 2
    w_full = torch.zeros_like(ref)
    w_full[pos] = w
    (ref * w_full).sum().backward()
    out_err = float((out - ref.detach()[pos]).abs().max())
    grad_err = float((q.grad - ref_in[0].grad[pos]).abs().max())
    return fires, out_err, grad_err


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_fires_twice_at_cp1(use_reentrant):
    fires, out_err, grad_err = fires_under_checkpoint(use_reentrant)
    assert fires == 2 and out_err < 1e-12 and grad_err < 1e-12, (fires, out_err, grad_err)


@pytest.mark.timeout(120)
def test_non_reentrant_checkpoint_fires_twice_with_cp(pool2):
    for fires, out_err, grad_err in pool2.run(fires_under_checkpoint, False):
        assert fires == 2 and out_err < 1e-12 and grad_err < 1e-12, (fires, out_err, grad_err)


# ---------------------------------------------------------------------------
# what the op saves for backward is freed after backward (no reference cycle)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("retain", [False, True])
def test_saved_tensors_are_freed_after_backward(retain):
    import gc
    import weakref

    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.blockdiag_cp import kernels
    from megatron_ext.testing import override_kernel

    refs = []

    def recording_forward(*args, **kw):
        out, lse, aux = kernels.dense_forward(*args, **kw)
        refs.append(weakref.ref(lse))
        return out, lse, aux

    state = bdcp.BlockDiagCPState.build(GOOD, attn_backend="dense")
    q, k, v = (_local(state, t) for t in _qkv(GOOD.numel(), seed=12))
    with override_kernel("dense", kernels.Kernel(recording_forward, kernels.dense_backward)), \
            bdcp.blockdiag_cp_step(state):
        out = bdcp.blockdiag_cp_attention(q, k, v)
        saved = weakref.ref(out.grad_fn)
        loss = out.sum()
        del out
        loss.backward(retain_graph=retain)
        if retain:
            loss.backward()  # the retained graph still differentiates (see the accumulation tests)
    del loss
    gc.collect()
    assert refs and all(r() is None for r in refs), "a kernel's lse outlived the step"
    assert saved() is None, "the op's node (and what it saved) outlived the step"


# ---------------------------------------------------------------------------
# 11. one rank fails where its peers do not: the same error on every rank, then the next step works
# ---------------------------------------------------------------------------

# A hang fails a call after this long (the fixed engine answers these cases in well under a second).
HANG_S = 60


def _next_step_error():
    """A full step (build, forward, backward) after a failure: its largest error against the reference."""
    import megatron_ext.blockdiag_cp as bdcp

    state = bdcp.BlockDiagCPState.build(GOOD, attn_backend="dense", kv_exchange="a2a")
    full = _qkv(GOOD.numel(), seed=21)
    q, k, v = (_local(state, t) for t in full)
    with bdcp.blockdiag_cp_step(state):
        out = bdcp.blockdiag_cp_attention(q, k, v)
        out.sum().backward()
    ref_in = [t.detach().requires_grad_(True) for t in full]
    ref = reference_attention(*ref_in, GOOD)
    ref.sum().backward()
    pos = state.local_positions
    return max(float((out - ref.detach()[pos]).abs().max()), float((q.grad - ref_in[0].grad[pos]).abs().max()))


class _FailInBackward(torch.autograd.Function):
    """Identity forward; backward raises (a later op's backward failing after attention's backward)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("injected backward failure")


def one_rank_fails(case):
    """Rank 0 alone goes wrong in ``case``; returns per rank (error, its cause's type, next-step error)."""
    import torch.distributed as dist

    import megatron_ext.blockdiag_cp as bdcp

    rank = dist.get_rank()
    state = bdcp.BlockDiagCPState.build(GOOD, attn_backend="dense", kv_exchange="a2a")
    q, k, v = (_local(state, t) for t in _qkv(GOOD.numel(), seed=20))
    bad = rank == 0
    caught = {}

    def step():
        if case == "no_state" and bad:  # no step context: attention finds no state, CP > 1
            bdcp.blockdiag_cp_attention(q, k, v)
            return
        with bdcp.blockdiag_cp_step(state):
            if case == "softmax_offset":
                bdcp.blockdiag_cp_attention(q, k, v, softmax_offset=torch.zeros(3 if bad else 4, dtype=q.dtype))
            elif case == "window_size":
                bdcp.blockdiag_cp_attention(q, k, v, window_size=(4, 2) if bad else (4, 0))
            elif case == "caught_in_step":  # the caller catches the error and goes on inside the step
                caught["err"] = catch(lambda: bdcp.blockdiag_cp_attention(
                    q, k, v, softmax_offset=torch.zeros(3 if bad else 4, dtype=q.dtype)))
                bdcp.blockdiag_cp_attention(q, k, v).sum().backward()
            elif case in ("user_code", "no_state"):
                if bad:
                    raise ValueError("injected user-code failure")
                bdcp.blockdiag_cp_attention(q, k, v).sum().backward()
            elif case == "backward":
                out = bdcp.blockdiag_cp_attention(_FailInBackward.apply(q) if bad else q, k, v)
                out.sum().backward()
            elif case == "after_backward":  # user code fails after the step's last collective
                bdcp.blockdiag_cp_attention(q, k, v).sum().backward()
                if bad:
                    raise ValueError("injected user-code failure")

    try:
        step()
        err, cause = None, None
    except Exception as exc:  # noqa: BLE001 - returned for the parent's assertions
        err, cause = (type(exc).__name__, str(exc)), type(exc.__cause__).__name__
    dist.barrier()  # nobody is left inside a collective
    return err, cause, caught.get("err"), _next_step_error()


@pytest.mark.timeout(2 * HANG_S)
@pytest.mark.parametrize("case,needle", [
    ("softmax_offset", "passed invalid attention arguments"),
    ("window_size", "passed invalid attention arguments"),
    ("no_state", "ran block-diagonal CP attention with CP > 1 but no step state"),
    ("user_code", "left its blockdiag_cp_step with an exception"),
    ("backward", "left its blockdiag_cp_step with an exception"),
    ("after_backward", "left its blockdiag_cp_step with an exception"),
])
def test_one_rank_failing_raises_the_same_error_on_every_rank(pool2, case, needle):
    results = pool2.run(one_rank_fails, case, timeout=HANG_S)
    for rank, (err, cause, _, next_step) in enumerate(results):
        assert err is not None and err[0] == "BlockDiagCPError", (case, rank, err)
        assert f"CP rank 0 {needle}" in err[1] and "raised on every CP rank" in err[1], (case, rank, err)
        assert next_step < 1e-12, (case, rank, next_step)  # both ranks are in step again
    own, peer = results[0][0][1], results[1][0][1]
    assert "own error gives the value" not in own and "CP rank 0's own error gives the value" in peer, (own, peer)
    value = {"softmax_offset": "softmax_offset has shape (3,)", "window_size": "window_size=(4, 2)",
             "user_code": "injected user-code failure", "backward": "injected backward failure",
             "after_backward": "injected user-code failure", "no_state": "refusing to attend"}[case]
    assert value in own and value not in peer, (own, peer)
    if case in ("user_code", "backward", "after_backward"):
        assert results[0][1] == "ValueError", results[0]  # rank 0's error is chained to its own


@pytest.mark.timeout(2 * HANG_S)
def test_an_error_caught_inside_the_step_leaves_the_ranks_in_step(pool2):
    for rank, (err, _, caught, next_step) in enumerate(pool2.run(one_rank_fails, "caught_in_step",
                                                                 timeout=HANG_S)):
        assert caught is not None and "CP rank 0 passed invalid attention arguments" in caught[1], (rank, caught)
        assert err is None and next_step < 1e-12, (rank, err, next_step)


def ranks_at_different_points():
    """Rank 0 builds the next step while rank 1 is still agreeing on q/k/v (a skipped call)."""
    import torch.distributed as dist

    import megatron_ext.blockdiag_cp as bdcp

    state = bdcp.BlockDiagCPState.build(GOOD, attn_backend="dense")
    q, k, v = (_local(state, t) for t in _qkv(GOOD.numel(), seed=22))
    if dist.get_rank() == 0:
        err = catch(lambda: bdcp.BlockDiagCPState.build(GOOD, attn_backend="dense"))
    else:
        err = catch(lambda: bdcp.blockdiag_cp_attention(q, k, v, state=state))
    dist.barrier()
    return err, _next_step_error()


@pytest.mark.timeout(2 * HANG_S)
def test_ranks_at_different_agreement_points_raise_instead_of_aborting(pool2):
    results = pool2.run(ranks_at_different_points, timeout=HANG_S)
    for rank, (err, next_step) in enumerate(results):
        assert err is not None and err[0] == "BlockDiagCPError", (rank, err)
        assert "reached different agreement points" in err[1], (rank, err)
        assert "q/k/v agreement" in err[1] and "building a step state" in err[1], (rank, err)
        assert next_step < 1e-12, (rank, next_step)


def attention_arguments_per_rank(kwargs_per_rank):
    import torch.distributed as dist

    import megatron_ext.blockdiag_cp as bdcp

    state = bdcp.BlockDiagCPState.build(GOOD, attn_backend="dense")
    q, k, v = (_local(state, t) for t in _qkv(GOOD.numel(), seed=23))
    kwargs = kwargs_per_rank[dist.get_rank()]
    err = catch(lambda: _run_in_step_kw(bdcp, state, q, k, v, kwargs))
    dist.barrier()
    return err


def _run_in_step_kw(bdcp, state, q, k, v, kwargs):
    with bdcp.blockdiag_cp_step(state):
        bdcp.blockdiag_cp_attention(q, k, v, **kwargs).sum().backward()


@pytest.mark.timeout(2 * HANG_S)
@pytest.mark.parametrize("name,values,shown", [
    ("softmax_scale", (0.125, 0.25), ("0.125", "0.25")),
    ("dropout_p", (0.0, 0.1), ("0.0", "0.1")),
])
def test_softmax_scale_and_dropout_that_differ_across_ranks_are_refused(pool2, name, values, shown):
    errs = pool2.run(attention_arguments_per_rank, [{name: x} for x in values], timeout=HANG_S)
    for rank, err in enumerate(errs):
        assert err is not None and err[0] == "BlockDiagCPError", (rank, err)
        assert f"{name} {shown[0]} vs {shown[1]} (this rank: {shown[rank]})" in err[1], (rank, err)


def one_rank_input_and_launch_errors(case):
    import os

    import torch.distributed as dist

    import megatron_ext.blockdiag_cp as bdcp

    rank = dist.get_rank()
    if case == "float_ids":
        err = catch(lambda: bdcp.BlockDiagCPState.build(GOOD.float() if rank == 0 else GOOD))
    else:  # rank 0 launched as one process per node, rank 1 as two
        before = os.environ["LOCAL_WORLD_SIZE"]
        os.environ["LOCAL_WORLD_SIZE"] = str(rank + 1)
        try:
            err = catch(lambda: bdcp.BlockDiagCPState.build(GOOD, layout="balanced", attn_backend="dense"))
        finally:
            os.environ["LOCAL_WORLD_SIZE"] = before
    dist.barrier()
    return err


@pytest.mark.timeout(2 * HANG_S)
def test_a_bad_input_on_one_rank_names_the_value_or_the_rank_that_had_it(pool2):
    own, peer = pool2.run(one_rank_input_and_launch_errors, "float_ids", timeout=HANG_S)
    assert own[0] == peer[0] == "BlockDiagCPError", (own, peer)
    assert "doc_ids must be an integer tensor (got torch.float32)" in own[1], own
    assert "another CP rank (CP rank 0; that rank's own error gives the value)" in peer[1], peer
    assert "doc_ids must be an integer tensor;" in peer[1] and "got" not in peer[1], peer


@pytest.mark.timeout(2 * HANG_S)
def test_a_local_world_size_that_differs_per_rank_is_named(pool2):
    for rank, err in enumerate(pool2.run(one_rank_input_and_launch_errors, "local_world_size", timeout=HANG_S)):
        assert err is not None and err[0] == "BlockDiagCPError", (rank, err)
        assert f"LOCAL_WORLD_SIZE (processes per node) differs across the CP ranks (1 vs 2; this rank: " \
               f"{rank + 1})" in err[1], (rank, err)
