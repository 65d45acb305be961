"""Attention backends on real gloo groups: the te -> flash -> dense chain, strict mode, kernel
failures, the fire counter, call-time fallback, and the flash / TE kernel doubles.

Availability and kernels are set per rank inside the worker functions through the
engine's test hooks (``megatron_ext.testing``: override_availability / override_kernel /
override_library, always restored). The flash and TE doubles
(megatron_ext/testing/doubles.py) check OUR metadata and plumbing on CPU, not the real
CUDA kernels; the GPU check (scripts/gpu_check.sh) runs those on a GPU.
"""

import contextlib
import logging
import math

import pytest
import torch

from megatron_ext.testing import WorkerPool, captured_engine_logs, reference_attention
from megatron_ext.testing.cases import make_doc_ids

LAYOUTS = ("contiguous", "zigzag", "balanced")
EXCHANGES = ("allgather", "halo", "a2a")
TOL = 1e-5
KV_COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
                  "batch_isend_irecv")


@pytest.fixture(scope="module")
def pools():
    """pools(n) -> a gloo WorkerPool of n ranks, spawned once for this module."""
    made = {}

    def get(n):
        if n not in made:
            made[n] = WorkerPool(n)
        return made[n]

    yield get
    for pool in made.values():
        pool.close()


# ---------------------------------------------------------------------------
# worker-side helpers (run on every rank)
# ---------------------------------------------------------------------------


def _rank():
    return torch.distributed.get_rank()


@contextlib.contextmanager
def availability(missing=(), *, device_blind=True, call_ok=()):
    """This rank's kernels: ``missing`` are "not installed", te/flash otherwise installed.

    device_blind: static availability ignores the device (what a CUDA machine with the
    library would say); False keeps the real check ("needs CUDA" on this CPU).
    call_ok: backends whose call-time check passes for fp32/fp64 CPU tensors (doubles).
    Everything replaced is restored on exit.
    """
    from megatron_ext.testing import override_availability

    with contextlib.ExitStack() as stack:
        for name in ("te", "flash"):
            if missing is None:
                ok, reason = None, "test double takes CPU tensors"
            elif name in missing:
                ok, reason = False, f"{name} is not installed on this test rank"
            else:
                ok, reason = True, f"{name} installed (test)"
            stack.enter_context(override_availability(name, ok, reason, any_device=device_blind,
                                                      any_call=name in call_ok))
        yield


@contextlib.contextmanager
def counted_collectives():
    """Count this rank's K/V collectives (the exchange calls them through torch.distributed)."""
    import torch.distributed as dist

    counts = {name: 0 for name in KV_COLLECTIVES}
    saved = {name: getattr(dist, name) for name in KV_COLLECTIVES}

    def wrap(name):
        def counted(*args, **kwargs):
            counts[name] += 1
            return saved[name](*args, **kwargs)
        return counted

    for name in KV_COLLECTIVES:
        setattr(dist, name, wrap(name))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _inputs(case, S, b, hq, hkv, d, seed=7):
    cp = torch.distributed.get_world_size()
    doc_ids = make_doc_ids(case, S, cp)
    if doc_ids.dim() == 2 and doc_ids.shape[0] != b:
        raise ValueError("per-row doc ids need b rows")
    S = doc_ids.shape[-1]
    g = torch.Generator().manual_seed(seed)
    shapes = [(S, b, hq, d), (S, b, hkv, d), (S, b, hkv, d), (S, b, hq, d)]
    q, k, v, w = (torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes)
    return doc_ids, q, k, v, w


def _rel(a, b):
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _step(state, q, k, v, w, calls=1, scale=None):
    """One step: forward ``calls`` times, backward through all of them; returns (out, local grads)."""
    import megatron_ext.blockdiag_cp as bdcp

    local = [state.shard(t).detach().requires_grad_() for t in (q, k, v)]
    with bdcp.blockdiag_cp_step(state):
        outs = [bdcp.blockdiag_cp_attention(*local, softmax_scale=scale) for _ in range(calls)]
        (sum(outs) * state.shard(w)).sum().backward()
    return outs[0], local


def _errors(state, out, local, ref, ref_in, calls=1):
    return [_rel(out, state.shard(ref))] + [
        _rel(t.grad, calls * state.shard(r.grad)) for t, r in zip(local, ref_in)]


def _reference(doc_ids, q, k, v, w, scale=None):
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*ref_in, doc_ids, scale=scale)
    (ref * w).sum().backward()
    return ref, ref_in


# ---------------------------------------------------------------------------
# the chain: te -> flash -> dense, agreed across ranks
# ---------------------------------------------------------------------------


def w_resolve(missing_by_rank, attn_backend, device_blind=True, builds=2):
    from megatron_ext.blockdiag_cp import BlockDiagCPState

    ids = torch.tensor([1] * 10 + [2] * 6 + [3] * 8)
    with availability(missing_by_rank.get(_rank(), ()), device_blind=device_blind), \
            captured_engine_logs() as records:
        reports = [BlockDiagCPState.build(ids, attn_backend=attn_backend, device="cpu").report()
                   for _ in range(builds)]
    first = reports[0]
    return {"requested": first["attn_backend_requested"], "backend": first["attn_backend"],
            "reason": first["attn_backend_reason"],
            "stable": all(r["attn_backend"] == first["attn_backend"] for r in reports),
            "logs": [(rec.levelno, rec.getMessage()) for rec in records]}


CHAIN = [
    # id, cp, {rank: missing backends}, requested, expected backend, reason text per rank kind
    ("all_have_te", 2, {}, None, "te", None),
    ("te_missing_everywhere", 2, {0: ("te",), 1: ("te",)}, None, "flash", "not installed"),
    ("te_missing_on_rank1", 2, {1: ("te",)}, None, "flash", "unavailable on another CP rank"),
    ("te_missing_on_rank2_of4", 4, {2: ("te",)}, "te", "flash", "unavailable on another CP rank"),
    ("only_dense", 2, {0: ("te", "flash"), 1: ("te", "flash")}, None, "dense", "not installed"),
    ("te_and_flash_missing_on_different_ranks", 4, {1: ("te",), 3: ("flash",)}, None, "dense",
     "unavailable on another CP rank"),
    ("explicit_flash_all_have_it", 2, {0: ("te",), 1: ("te",)}, "flash", "flash", None),
    ("explicit_dense", 2, {}, "dense", "dense", None),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,cp,missing,requested,expected,reason", CHAIN, ids=[c[0] for c in CHAIN])
def test_chain_resolves_identically_on_every_rank(pools, name, cp, missing, requested, expected, reason):
    results = pools(cp).run(w_resolve, missing, requested)
    assert [r["backend"] for r in results] == [expected] * cp, results
    assert all(r["stable"] for r in results)
    assert all(r["requested"] == (requested or "te") for r in results)
    for rank, r in enumerate(results):
        if reason is None:  # no fallback: the reason is the backend's own, nothing logged
            assert "fell back" not in r["reason"] and r["logs"] == [], r
            continue
        assert r["reason"].startswith(f"fell back to {expected}:"), r
        if missing.get(rank):  # the rank that lacks a backend names its own cause
            assert "not installed on this test rank" in r["reason"], r
        else:
            assert reason in r["reason"], r


@pytest.mark.timeout(60)
def test_reason_names_missing_cuda(pools):
    # Both libraries "installed" but the real static check sees a CPU device.
    results = pools(2).run(w_resolve, {}, None, False)
    for r in results:
        assert r["backend"] == "dense"
        assert "te: te needs CUDA (device is cpu)" in r["reason"], r
        assert "flash: flash needs CUDA (device is cpu)" in r["reason"], r


@pytest.mark.timeout(60)
@pytest.mark.parametrize("requested,level", [(None, logging.INFO), ("te", logging.WARNING),
                                             ("transformer-engine", logging.WARNING)])
def test_fallback_logged_once_info_for_default_warning_for_explicit(pools, requested, level):
    results = pools(2).run(w_resolve, {0: ("te",), 1: ("te",)}, requested, True, 3)
    for r in results:
        assert r["backend"] == "flash"
        assert len(r["logs"]) == 1, r["logs"]  # three builds, one record
        got_level, message = r["logs"][0]
        assert got_level == level, r["logs"]
        assert "attention backend te -> flash" in message and "not installed" in message


# ---------------------------------------------------------------------------
# strict mode
# ---------------------------------------------------------------------------


def w_strict(missing_by_rank, attn_backend, run_step=False):
    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.testing import override_kernel
    from megatron_ext.testing.doubles import CALLS, kernel_double

    doc_ids, q, k, v, w = _inputs("short", 48, 1, 2, 1, 4)
    with availability(missing_by_rank.get(_rank(), ()), call_ok=("flash",)), \
            override_kernel("flash", kernel_double()), counted_collectives() as counts:
        try:
            state = bdcp.BlockDiagCPState.build(doc_ids, attn_backend=attn_backend, kv_exchange="a2a",
                                                strict=True)
        except bdcp.BlockDiagCPError as exc:
            return {"raised": str(exc), "counts": dict(counts)}
        result = {"raised": None, "backend": state.attn_backend}
        if run_step:
            CALLS.clear()
            ref, ref_in = _reference(doc_ids, q, k, v, w)
            out, local = _step(state, q, k, v, w)
            result.update(errors=_errors(state, out, local, ref, ref_in), double_calls=len(CALLS),
                          backend_after=state.attn_backend)
        result["counts"] = dict(counts)
        return result


@pytest.mark.timeout(60)
@pytest.mark.parametrize("requested", ["te", None])
def test_strict_raises_on_every_rank_before_any_kv_collective(pools, requested):
    results = pools(4).run(w_strict, {3: ("te",)}, requested)
    for r in results:
        assert r["raised"] and "strict mode" in r["raised"] and "'te'" in r["raised"], r
        assert sum(r["counts"].values()) == 0, r  # no K/V collective was issued


@pytest.mark.timeout(60)
def test_strict_passes_when_every_rank_has_the_backend(pools):
    results = pools(2).run(w_strict, {0: ("te",), 1: ("te",)}, "flash", True)
    for r in results:
        assert r["raised"] is None and r["backend"] == r["backend_after"] == "flash", r
        assert r["double_calls"] >= 1 and max(r["errors"]) < TOL, r
        assert r["counts"]["batch_isend_irecv"] >= 1, r  # the exchange ran


# ---------------------------------------------------------------------------
# kernel failure after the exchange
# ---------------------------------------------------------------------------


def w_kernel_failure(fail_rank, phase, exchange):
    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.blockdiag_cp import kernels
    from megatron_ext.testing import override_kernel

    doc_ids, q, k, v, w = _inputs("short", 64, 1, 4, 2, 8)
    outcome, failures = None, None
    dense = kernels.kernel_for("dense")

    def boom(*args, **kwargs):
        raise RuntimeError(f"injected {phase} failure")

    failing = kernels.Kernel(boom if phase == "forward" else dense.forward,
                             boom if phase == "backward" else dense.backward)
    this_rank_fails = override_kernel("dense", failing) if _rank() == fail_rank else contextlib.nullcontext()
    with availability(("te", "flash")), this_rank_fails, counted_collectives() as counts:
        state = bdcp.BlockDiagCPState.build(doc_ids, kv_exchange=exchange, layout="zigzag")
        try:
            _step(state, q, k, v, w)
            outcome = "no error"
        except bdcp.BlockDiagCPError as exc:
            outcome = str(exc)
        failures = list(state.kernel_failures)
        exchanged = sum(counts.values())
    # The group is still aligned: a clean step right after gives the right answer.
    ref, ref_in = _reference(doc_ids, q, k, v, w)
    with availability(("te", "flash")):
        state = bdcp.BlockDiagCPState.build(doc_ids, kv_exchange=exchange, layout="zigzag")
        out, local = _step(state, q, k, v, w)
    return {"outcome": outcome, "failures": failures, "exchanged": exchanged,
            "after": max(_errors(state, out, local, ref, ref_in))}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("phase", ["forward", "backward"])
@pytest.mark.parametrize("exchange", ["allgather", "a2a"])
def test_kernel_failure_on_one_rank_raises_on_every_rank(pools, phase, exchange):
    fail_rank = 1
    results = pools(2).run(w_kernel_failure, fail_rank, phase, exchange, timeout=60)
    for rank, r in enumerate(results):
        assert r["outcome"].startswith("an attention kernel failed on at least one CP rank"), r
        assert r["exchanged"] >= 1, r  # the failure came after the K/V exchange
        if rank == fail_rank:
            assert len(r["failures"]) == 1 and f"failed in {phase} on CP rank {fail_rank}" in r["failures"][0]
            assert f"injected {phase} failure" in r["outcome"], r
        else:
            assert r["failures"] == [] and "this rank's kernels succeeded" in r["outcome"], r
        assert r["after"] < TOL, r


# ---------------------------------------------------------------------------
# fire counter
# ---------------------------------------------------------------------------


def w_fire_counter(calls):
    import megatron_ext.blockdiag_cp as bdcp

    doc_ids, q, k, v, w = _inputs("short", 32, 1, 2, 2, 4)
    bdcp.reset_cp_attn_fire_count()
    start = bdcp.cp_attn_fire_count()
    with availability(("te", "flash")):
        state = bdcp.BlockDiagCPState.build(doc_ids)
        _step(state, q, k, v, w, calls=calls)
    counted = bdcp.cp_attn_fire_count()
    bdcp.reset_cp_attn_fire_count()
    return start, counted, bdcp.cp_attn_fire_count()


@pytest.mark.timeout(60)
def test_fire_counter_counts_every_call_and_resets(pools):
    for start, counted, after in pools(2).run(w_fire_counter, 3):
        assert (start, counted, after) == (0, 3, 0)


# ---------------------------------------------------------------------------
# call-time fallback: statically available, but the call is fp32 on CPU
# ---------------------------------------------------------------------------


def w_call_fallback(attn_backend, strict):
    import megatron_ext.blockdiag_cp as bdcp

    doc_ids, q, k, v, w = _inputs("short", 64, 1, 4, 2, 8)
    q, k, v, w = (t.float() for t in (q, k, v, w))
    with availability(()), captured_engine_logs() as records, counted_collectives() as counts:
        state = bdcp.BlockDiagCPState.build(doc_ids, attn_backend=attn_backend, strict=strict,
                                            kv_exchange="a2a")
        before = state.attn_backend
        try:
            out, local = _step(state, q, k, v, w, calls=2)
        except bdcp.BlockDiagCPError as exc:
            return {"raised": str(exc), "counts": dict(counts)}
    ref, ref_in = _reference(doc_ids, q.double(), k.double(), v.double(), w.double())
    return {"raised": None, "before": before, "after": state.attn_backend,
            "reason": state.report()["attn_backend_reason"],
            "errors": _errors(state, out, local, ref, ref_in, calls=2),
            "logs": [(rec.levelno, rec.getMessage()) for rec in records]}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("requested,level", [(None, logging.INFO), ("flash", logging.WARNING)])
def test_call_time_fallback_to_dense_on_every_rank(pools, requested, level):
    results = pools(2).run(w_call_fallback, requested, False)
    for r in results:
        assert r["raised"] is None
        assert r["before"] == (requested or "te") and r["after"] == "dense", r
        assert "needs CUDA tensors" in r["reason"], r
        assert max(r["errors"]) < 1e-4, r  # fp32 vs the fp64 reference
        messages = [m for _, m in r["logs"]]
        assert messages and all("for this call" in m for m in messages), r
        assert len(messages) == len(set(messages)), r  # two calls, each fallback logged once
        assert messages[-1].startswith("blockdiag-cp: attention backend flash -> dense"), r
        assert {lvl for lvl, _ in r["logs"]} == {level}, r
    assert len({r["reason"] for r in results}) == 1


@pytest.mark.timeout(60)
def test_call_time_fallback_is_an_error_in_strict_mode(pools):
    results = pools(2).run(w_call_fallback, "flash", True)
    for r in results:
        assert r["raised"] and "strict mode" in r["raised"] and "needs CUDA tensors" in r["raised"], r
        assert sum(r["counts"].values()) == 0, r


# ---------------------------------------------------------------------------
# kernel doubles: the flash and TE contracts in plain torch
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def installed_double(setup):
    """Install one double; yields the backend name to request."""
    from megatron_ext.testing import doubles as fd
    from megatron_ext.testing import override_kernel, override_libraries

    fd.CALLS.clear()
    if setup == "flash_kernel":  # the engine's flash kernel pair replaced outright
        with availability(("te",), call_ok=("flash",)), override_kernel("flash", fd.kernel_double()):
            yield "flash"
        return
    if setup == "flash_lib_flash_attn":  # kernels.flash_forward/backward over flash-attn 2.6+'s calls
        lib, iface = fd.fake_flash_attn("2.8.3")
        libraries = {"flash_attn": lib, "flash_attn.flash_attn_interface": iface}
    elif setup == "flash_lib_torch":  # ... over torch's own flash ops (flash-attn absent)
        libraries = {"flash_attn": None, "torch.ops.aten.flash": fd.fake_torch_flash_ops(),
                     "torch.nn.attention.varlen": object()}
    elif setup.startswith("te_"):  # kernels.te_forward/backward over a fake fused_attn
        libraries = fd.fake_te(stats_layout=setup[len("te_"):])
    else:
        raise KeyError(setup)
    backend = "te" if setup.startswith("te_") else "flash"
    # missing=None keeps the real "installed" check: it must find the fake libraries.
    with override_libraries(libraries), availability(None, call_ok=(backend,)):
        yield backend


def w_double(setup, case, S, b, hq, hkv, d, layouts, exchanges, scale=None, kv_backward=None):
    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.testing import doubles as fd

    doc_ids, q, k, v, w = _inputs(case, S, b, hq, hkv, d)
    ref, ref_in = _reference(doc_ids, q, k, v, w, scale)
    results = {}
    extra = {}
    with installed_double(setup) as backend:
        for layout in layouts:
            for exchange in exchanges:
                state = bdcp.BlockDiagCPState.build(doc_ids, layout=layout, kv_exchange=exchange,
                                                    attn_backend=backend, kv_backward=kv_backward)
                out, local = _step(state, q, k, v, w, scale=scale)
                report = state.report()
                has_queries = bool((state.doc_ids[:, state.local_positions] > 0).any())
                results[(layout, exchange)] = (_errors(state, out, local, ref, ref_in),
                                               report["attn_backend"], report["kernel_failures"],
                                               has_queries)
        extra["calls"] = [c["kind"] for c in fd.CALLS]
        extra["causal"] = [c["causal"] for c in fd.CALLS]
        extra["steps_with_queries"] = sum(r[3] for r in results.values())
        extra["reason"] = report["attn_backend_reason"]
    return results, extra


def _check_double(results, backend, kind=None, combos=9):
    for rank, (per_rank, extra) in enumerate(results):
        assert len(per_rank) == combos
        for key, (errs, got, failures, _) in per_rank.items():
            assert failures == [], (rank, key, failures)
            assert got == backend, (rank, key, got)  # no silent fallback to dense
            assert max(errs) < TOL, (rank, key, errs)
        if kind is not None:  # only the double ran, at least one causal call per step with queries
            assert set(extra["calls"]) <= {kind}, (rank, extra["calls"])
            assert sum(extra["causal"]) == extra["steps_with_queries"], (rank, extra)


DOUBLE_CASES = [  # case, b, hq, hkv, d: per-row doc ids (b2) and shared ids folded into heads
    ("b2", 2, 4, 2, 8),
    ("short", 2, 4, 2, 8),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("case,b,hq,hkv,d", DOUBLE_CASES, ids=[c[0] for c in DOUBLE_CASES])
def test_flash_double_every_layout_and_exchange(pools, cp, case, b, hq, hkv, d):
    results = pools(cp).run(w_double, "flash_kernel", case, 96, b, hq, hkv, d, LAYOUTS, EXCHANGES)
    _check_double(results, "flash", "kernel")


@pytest.mark.timeout(120)
def test_flash_double_all_padding_ranks_never_call_the_kernel(pools):
    # pad_tail at cp=4: whole shards are padding; the double refuses a call with no segments.
    results = pools(4).run(w_double, "flash_kernel", "pad_tail", 96, 1, 4, 2, 8, LAYOUTS, EXCHANGES)
    _check_double(results, "flash", "kernel")
    assert any(not r[3] for per_rank, _ in results for r in per_rank.values())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("api,kind", [("flash_attn", "flash_attn"), ("torch", "torch_flash")])
@pytest.mark.parametrize("kv_backward", ["refetch", "save"])
def test_flash_forward_backward_over_each_library(pools, api, kind, kv_backward):
    # kernels.flash_forward / flash_backward themselves run; the lse goes out as [H, T] and back.
    results = pools(2).run(w_double, f"flash_lib_{api}", "b2", 64, 2, 4, 2, 8, ("zigzag", "balanced"),
                           ("allgather", "a2a"), 0.29, kv_backward)
    _check_double(results, "flash", kind, combos=4)
    assert all(extra["reason"] == ("flash_attn importable" if api == "flash_attn" else
                                   "torch_varlen_attn importable") for _, extra in results)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("stats", ["thd", "padded"])
def test_te_double_runs_te_forward_backward_end_to_end(pools, cp, stats):
    # kernels.te_forward / te_backward over TE's fused_attn spelling; both softmax-stats layouts.
    results = pools(cp).run(w_double, f"te_{stats}", "short", 96, 2, 4, 2, 8, LAYOUTS, EXCHANGES)
    _check_double(results, "te", "te")
    for _, extra in results:
        assert extra["reason"] == "TransformerEngine importable"


def w_library_gates(libraries_kind):
    """What ``installed`` says for a library at a version the streamed kernels cannot use."""
    from megatron_ext.blockdiag_cp import kernels
    from megatron_ext.testing import doubles as fd
    from megatron_ext.testing import override_libraries

    libs = {
        "flash_attn_2_0": {"flash_attn": fd.fake_flash_attn("2.0.4")[0], "torch.ops.aten.flash": None,
                           "torch.nn.attention.varlen": None},
        "flash_attn_2_5_with_torch": {"flash_attn": fd.fake_flash_attn("2.5.9")[0],
                                      "torch.ops.aten.flash": fd.fake_torch_flash_ops(),
                                      "torch.nn.attention.varlen": object()},
        "te_1_13": fd.fake_te(version="1.13.0"),
    }[libraries_kind]
    with override_libraries(libs):
        return {b: kernels.installed(b) for b in ("flash", "te")}


def test_library_versions_are_gated():
    flash_old = w_library_gates("flash_attn_2_0")["flash"]
    assert flash_old[0] is False and "2.0.4" in flash_old[1] and "top-left" in flash_old[1], flash_old
    # flash-attn 2.5 lacks the calls used here: torch's own flash ops take over.
    assert w_library_gates("flash_attn_2_5_with_torch")["flash"] == (True, "torch_varlen_attn importable")
    te_old = w_library_gates("te_1_13")["te"]
    assert te_old[0] is False and "1.13.0" in te_old[1] and "transformer-engine[pytorch]>=2.1" in te_old[1], te_old


def test_te_reads_a_received_chunks_k_and_v_in_place():
    """A received chunk is K and V fused per head ([n, h, Dk + Dv]); split, its halves are TE's thd_th2d
    layout. They reach fused_attn as they are, and dk / dv come back as the halves of one buffer, which
    the op sends home without a cat. Same numbers as contiguous copies; anything else is copied."""
    from megatron_ext.blockdiag_cp import kernels
    from megatron_ext.testing import doubles as fd
    from megatron_ext.testing import override_libraries

    g = torch.Generator().manual_seed(3)
    n, m, hq, h, d = 24, 10, 4, 2, 8
    chunk = torch.randn(n, h, 2 * d, generator=g, dtype=torch.float64)
    k, v = chunk[..., :d], chunk[..., d:]
    q, dout = (torch.randn(m, hq, d, generator=g, dtype=torch.float64) for _ in range(2))
    cu = [torch.tensor([0, 4, m], dtype=torch.int32), torch.tensor([0, 9, n], dtype=torch.int32)]
    seg = kernels.Segments(cu[0], cu[1], 6, 15, (4, 6), (9, 15), causal=False)
    assert kernels.kv_halves(k, v) and not kernels.kv_halves(k.contiguous(), v.contiguous())
    assert not kernels.kv_halves(k[::2], v[1::2]) and not kernels.kv_halves(v, k)

    results = {}
    for version in ("2.14.0", "2.15.0"):  # dk / dv in the qkv layout (2.14) and in dqkv_layout (2.15)
        for name, (kk, vv) in {"halves": (k, v), "copies": (k.contiguous(), v.contiguous())}.items():
            libraries = fd.fake_te(version=version)
            with override_libraries(libraries):
                assert kernels._te_inputs(q, kk, vv)[1] is kk  # halves in place; contiguous ones as they are
                out, lse, aux = kernels.te_forward(q, kk, vv, seg, 0.3)
                dq, dk, dv = kernels.te_backward(dout, q, kk, vv, out, lse, aux, seg, 0.3)
            results[version, name] = (out, lse, dq, dk, dv)
            layout = "thd_th2d" if name == "halves" else "thd_thd_thd"
            assert libraries["transformer_engine.pytorch.cpp_extensions.fused_attn"].layouts == [layout] * 2
            assert kernels.kv_halves(dk, dv) == (name == "halves")
        for a, b in zip(results[version, "halves"], results[version, "copies"]):
            assert torch.equal(a, b)
    # MLA's unequal head dims and gathered rows are not one buffer's halves: copied, thd_thd_thd
    libraries = fd.fake_te()
    with override_libraries(libraries):
        gathered = kernels.Segments(cu[0], torch.tensor([0, 5, 12], dtype=torch.int32), 6, 7, (4, 6), (5, 7), False)
        kernels.te_forward(q, k.index_select(0, torch.arange(0, n, 2)), v[::2], gathered, 0.3)
        kernels.te_forward(q, k, v[..., :4], seg, 0.3)
    assert libraries["transformer_engine.pytorch.cpp_extensions.fused_attn"].layouts == ["thd_thd_thd"] * 2


def test_te_needs_cudnn_9_6_for_grouped_kv_heads():
    from megatron_ext.blockdiag_cp import kernels
    from megatron_ext.testing import doubles as fd
    from megatron_ext.testing import override_libraries

    q = torch.empty(1, 4, 8, device="meta", dtype=torch.bfloat16)
    fake_cuda = type("Q", (), {"device": torch.device("cuda"), "dtype": torch.bfloat16, "shape": q.shape})()
    with override_libraries(fd.fake_te(cudnn=90500)):
        ok, why = kernels.call_availability("te", fake_cuda, 0.0, kv_heads=2)
        assert not ok and "cuDNN >= 9.6" in why and "90500" in why, why
        assert kernels.call_availability("te", fake_cuda, 0.0, kv_heads=4) == (True, "ok")  # MHA: fine
    with override_libraries(fd.fake_te(cudnn=90600)):
        assert kernels.call_availability("te", fake_cuda, 0.0, kv_heads=2) == (True, "ok")


# ---------------------------------------------------------------------------
# the GPU check must not rot: its dry run takes the same code path on CPU
# ---------------------------------------------------------------------------


@pytest.mark.timeout(330)
def test_gpu_check_dry_run(tmp_path):
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "MEGATRON_EXT_STAGE_COLLECTIVES_ON_CPU")}
    env.update(OUT=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run(["bash", os.path.join(root, "scripts", "gpu_check.sh"), "--dry-run",
                           "--block-megatron"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    lines = [row for row in rows if row["suite"] == "gpu_check"]
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    by_check = {}
    for line in lines:
        by_check.setdefault(line["check"], []).append(line)
    assert all(line["passed"] for line in lines), [line for line in lines if not line["passed"]]
    env_line = by_check["env"][0]
    assert env_line["engine_imported_megatron"] == [] and env_line["megatron_core_installed"] is False
    assert by_check["te"][0]["status"] == "not_run"  # no TransformerEngine here: said so, not faked
    loopback = by_check["loopback_cp8"]  # one rank of cp 8 per process, chunks handed over on its device
    assert sorted((r["mix"], r["layout"], r["rank"], r["cp"], r["relayout"]) for r in loopback) == sorted(
        [(m, lay, r, 8, "none") for m, lay in (("single", "zigzag"), ("short", "zigzag"), ("short", "thd"))
         for r in (0, 7)] + [("heavy", "balanced", r, 8, "none") for r in (0, 3)]
        + [("short", "thd", r, 8, "balanced") for r in (0, 7)])  # relaid: timing only
    assert all(r["values"] == ("timing only" if r["relayout"] == "balanced" else "rank r's") for r in loopback)
    assert all(r["syncs"] == [0, 0] and min(r["kernel_calls"]) >= 1 and r["timed"] == "steady"
               and r["fwd_bwd_ms"] > 0 and r["first_fwd_bwd_ms"] > 0 and r["kernel_fwd_ms"] > 0
               and r["kernel_bwd_ms"] > 0 for r in loopback)
    accuracy = by_check["accuracy"]
    assert len(accuracy) == 2 * 3 * 9 * 2  # cp x cases (mix, rows2, variants) x layout-exchange x backends
    assert {(a["cp"], a["layout"], a["exchange"], a["backend"]) for a in accuracy} == {
        (cp, lay, ex, be) for cp in (2, 4) for lay in LAYOUTS for ex in EXCHANGES for be in ("flash", "dense")}
    assert all(a["resolved"] == [a["backend"]] and a["dry_run"] for a in accuracy)
    # every flash call of the variants case against the dense kernel on the same tensors, per layout
    assert [(c["cp"], c["layout"]) for c in by_check["flash_calls"]] == [(4, lay) for lay in LAYOUTS]
    assert all(min(c["calls_per_rank"]) >= 1 and c["bad_calls"] == [] for c in by_check["flash_calls"])
    assert {e["backend"] for e in by_check["engine_cp1"]} == {"flash", "dense"}
    assert all(e["kernel_fwd_bwd_ms"] > 0 and "engine_overhead_fraction" in e for e in by_check["engine_cp1"])
    assert by_check["matmul_peak"][0]["tflops"] > 0
    # the fused merge, the row ops and the send gather against their eager bodies (on CPU: the eager path,
    # Triton not used)
    assert [(m.get("op", "merge_rows_"), m["rows"], m["triton"]) for m in by_check["merge_kernel"]] == [
        ("merge_rows_", "runs", False), ("merge_rows_", "scattered", False), ("copy_rows_", "scattered", False),
        ("add_rows_", "scattered", False), ("sum_rows_", "repeated", False), ("gather_kv_rows_", "scattered", False)]
    assert all(m["passed"] for m in by_check["merge_kernel"])
    assert len(by_check["timing"]) == 1 + 3 + 3
    assert [(m["cp"], m["layout"], m["exchange"]) for m in by_check["memory"]] == [
        (cp, lay, ex) for cp in (2, 4) for lay, ex in (("zigzag", "a2a"), ("contiguous", "allgather"))]
    assert all(len(m["exposed_comm_fraction_per_rank"]) == m["cp"] for m in by_check["memory"])
    assert by_check["summary"][0]["passed"] and by_check["summary"][0]["te_checked"] is False
