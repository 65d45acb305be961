"""The flash and TE kernels against flash-attn's and TransformerEngine's own Python code, per version.

Each library version of the matrix (tests/engine/real_libraries.py: flash-attn 2.6.3 / 2.7.4.post1 / 2.8.3,
TE 1.13 / 2.1 / 2.8 / 2.14 / 2.15 / 2.20.2) is imported, as shipped (``.gl/``, put there by
scripts/ci/gpu_libs.sh), into a pair of gloo workers over an emulated C++ extension: flash-attn >= 2.7
registers its custom ops in the process for good, so each such release gets its own pair; the other
releases take turns in one shared pair, each unloaded before the next. So our calls go through the
library's real signatures, custom ops, argument plumbing and enums, and land where the release's C++
would take them:

- the kernel pair (kernels.flash_forward/backward, te_forward/backward) on its own: out, lse, dq,
  dk, dv against explicit fp64 math (megatron_ext.testing.doubles.varlen_math*) for causal and
  full segments, a sliding window, GQA and MLA head dims;
- the streamed op through the engine at cp 1 and 2: out, dq, dk, dv against
  ``reference_attention`` (fp64, one process), causal documents, a window, GQA, MLA;
- a release the kernels cannot drive is refused at backend resolution, naming the version and the
  fix, and the engine falls back with that reason (strict: raises on every rank).

torch's own flash ops (``aten::_flash_attention_forward/backward``) get the same treatment with the
schemas this torch registers: a CPU kernel is registered under the real ops, so the dispatcher binds
our arguments by the real schema.

A version missing from .gl/ skips with the reason (never passes silently).
"""

import pytest
import torch

from megatron_ext.testing import WorkerPool, reference_attention
from megatron_ext.testing.cases import make_doc_ids, thd_doc_ids
from real_libraries import FLASH_VERSIONS, TE_VERSIONS, missing_reason

TOL = 1e-5  # the libraries hand the lse over in fp32 (and TE runs fp32: _dtype)
MATRIX = [("flash-attn", v) for v in FLASH_VERSIONS] + [("te", v) for v in TE_VERSIONS]
# Releases the kernels refuse (kernels.FLASH_ATTN_MIN / TE_MIN), and those without a bottom-right
# sliding window (no bottom_right_diagonal before TE 2.14: such calls fall back).
REFUSED = {("te", "1.13.0")}
NO_WINDOW = {("te", "2.1.0"), ("te", "2.8.0")}

# ---------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------

_WORKER = {}  # this worker process's library and its cp-1 group


def w_load(kind, version):
    """Make ``version`` of ``kind`` this worker's library (the previous one's modules dropped first)."""
    import sys

    import real_libraries as rl

    if (_WORKER.get("kind"), _WORKER.get("version")) != (kind, version):
        _switch(rl, kind, version)
    return sorted(name for name in sys.modules if name.split(".")[0] in rl.LIBRARY_MODULES)


def _switch(rl, kind, version):
    import torch.distributed as dist

    rl.unload()
    if kind == "flash-attn":
        rl.load_flash_attn(version)
    elif kind == "te":
        rl.load_te(version, stats_layout="padded" if version == "2.8.0" else "thd")
    elif kind == "torch":
        if "aten_library" not in _WORKER:  # CPU kernels under the real aten ops, once per process
            _WORKER["aten_library"] = rl.register_aten_flash_cpu()
    else:
        raise KeyError(kind)
    if "solo" not in _WORKER:  # every rank makes every group, in the same order
        groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
        _WORKER["solo"] = groups[dist.get_rank()]
    _WORKER.update(kind=kind, version=version)


def _backend(kind):
    return "te" if kind == "te" else "flash"


def _hooks(kind):
    """The real install check (it must find the library), any device, and any dtype per call."""
    import contextlib

    from megatron_ext.testing import override_availability, override_library

    stack = contextlib.ExitStack()
    if kind == "torch":  # flash-attn absent: torch's own flash ops
        stack.enter_context(override_library("flash_attn", None))
    stack.enter_context(override_availability(_backend(kind), None, any_device=True, any_call=True))
    return stack


def _segments(q_lens, k_lens, causal, window=None):
    from megatron_ext.blockdiag_cp import kernels

    cu = lambda lens: torch.tensor((0,) + tuple(lens)).cumsum(0).to(torch.int32)  # noqa: E731
    return kernels.Segments(cu(q_lens), cu(k_lens), max(q_lens), max(k_lens), tuple(q_lens), tuple(k_lens),
                            causal, window)


def _dtype(kind):
    # TE's fused_attn_bwd up to 2.14 maps the dtype through TE_DType, which has no float64: TE runs fp32.
    return torch.float32 if kind == "te" else torch.float64


def _rel(a, b):
    return float((a.detach().double() - b.detach().double()).abs().max() / b.abs().max().clamp_min(1e-3))


def w_kernel_pair():
    """kernels.<backend>_forward/backward alone, per case: max rel. error of out, lse, dq, dk, dv or the error."""
    import real_libraries as rl
    from megatron_ext.blockdiag_cp import kernels
    from megatron_ext.testing.doubles import varlen_math, varlen_math_backward

    kind = _WORKER["kind"]
    kernel = kernels.kernel_for(_backend(kind))
    dtype = _dtype(kind)
    cases = {  # name: q_lens, k_lens, causal, window, (hq, hkv, dqk, dv)
        "causal_gqa": ((5, 9), (5, 9), True, None, (4, 2, 8, 8)),
        "full_mha": ((4, 6), (7, 3), False, None, (2, 2, 16, 16)),
        "causal_window_mla": ((9, 12), (9, 12), True, 3, (4, 2, 12, 8)),
        "full_window_gqa": ((6, 5), (8, 9), False, 4, (4, 1, 8, 8)),
        # a band with more queries than max_seqlen_k + 1 (a short key run at a chunk edge): flash's open
        # right edge must still reach every key
        "window_band_more_queries_than_keys": ((9, 4), (2, 3), False, 1, (4, 2, 8, 8)),
    }
    g = torch.Generator().manual_seed(5)
    out = {}
    with _hooks(kind):
        for name, (q_lens, k_lens, causal, window, (hq, hkv, dqk, dv)) in cases.items():
            seg = _segments(q_lens, k_lens, causal, window)
            q, k, v, dout = (torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).double() for shape in (
                (sum(q_lens), hq, dqk), (sum(k_lens), hkv, dqk), (sum(k_lens), hkv, dv), (sum(q_lens), hq, dv)))
            cq, ck = seg.cu_seqlens_q.tolist(), seg.cu_seqlens_k.tolist()
            ref_o, ref_l = varlen_math(q, k, v, cq, ck, 0.3, causal, window)
            ref_g = varlen_math_backward(dout, q, k, v, ref_o, ref_l, cq, ck, 0.3, causal, window)
            rl.CALLS.clear()
            q_, k_, v_, dout_ = (t.to(dtype) for t in (q, k, v, dout))
            try:
                o, lse, aux = kernel.forward(q_, k_, v_, seg, 0.3)
            except Exception as exc:  # noqa: BLE001 - returned to the parent for its assertion
                out[name] = f"forward: {type(exc).__name__}: {exc}"
                continue
            windows = {c["window"][0] for c in rl.CALLS}
            r = out[name] = {"errors": [_rel(o, ref_o), _rel(lse, ref_l)], "calls": len(rl.CALLS),
                             "shapes_ok": o.shape == ref_o.shape and lse.shape == ref_l.shape,
                             "window_reached": window is None or windows == {window}}
            try:
                grads = kernel.backward(dout_, q_, k_, v_, o, lse, aux, seg, 0.3)
            except Exception as exc:  # noqa: BLE001
                r["backward"] = f"{type(exc).__name__}: {exc}"
                continue
            r["errors"] += [_rel(a, b) for a, b in zip(grads, ref_g)]
            r["shapes_ok"] = r["shapes_ok"] and all(a.shape == b.shape for a, b in zip(grads, ref_g))
    return out


def w_meta_pair():
    """kernels.flash_forward/backward on meta tensors: the shapes the library's own fake kernels give."""
    from megatron_ext.blockdiag_cp import kernels

    return _meta_pair(kernels)


def _meta_pair(kernels):
    cu = lambda lens: torch.tensor((0,) + lens).cumsum(0).to(torch.int32).to("meta")  # noqa: E731
    seg = kernels.Segments(cu((5, 9)), cu((5, 9)), 9, 9, (5, 9), (5, 9), True, 3)
    q = torch.empty(14, 4, 12, device="meta", dtype=torch.bfloat16)  # MLA: q/k 12, v 8; GQA 4 over 2
    k = torch.empty(14, 2, 12, device="meta", dtype=torch.bfloat16)
    v = torch.empty(14, 2, 8, device="meta", dtype=torch.bfloat16)
    o, lse, aux = kernels.flash_forward(q, k, v, seg, 0.3)
    grads = kernels.flash_backward(torch.empty_like(o), q, k, v, o, lse, aux, seg, 0.3)
    return [tuple(o.shape), tuple(lse.shape), lse.dtype] + [tuple(t.shape) for t in grads]


META_SHAPES = [(14, 4, 8), (14, 4), torch.float32, (14, 4, 12), (14, 2, 12), (14, 2, 8)]


def w_installed():
    from megatron_ext.blockdiag_cp import kernels

    return kernels.installed(_backend(_WORKER["kind"]))


def _thd_padded(doc_ids: torch.Tensor, cp: int) -> torch.Tensor:
    """doc_ids (documents 1..n, no padding) with every document padded at its end to a multiple of 2 * cp,
    as THD packs them (any layout takes them; thd needs them so)."""
    lengths = torch.unique_consecutive(doc_ids, return_counts=True)[1]
    extents = -(-lengths // (2 * cp)) * (2 * cp)
    return thd_doc_ids(*(torch.nn.functional.pad(n.cumsum(0), (1, 0)) for n in (lengths, extents)))


def w_engine(cp, case, window, heads, strict=False):
    """One step per layout x exchange through the engine; per key: errors, backend, reason (or the error)."""
    import torch.distributed as dist

    import megatron_ext.blockdiag_cp as bdcp
    import real_libraries as rl

    kind = _WORKER["kind"]
    group = _WORKER["solo"] if cp == 1 else dist.group.WORLD
    hq, hkv, dk, dv = heads
    doc_ids = _thd_padded(make_doc_ids(case, 64, cp), cp)
    S = doc_ids.shape[-1]
    g = torch.Generator().manual_seed(11)
    dtype = _dtype(kind)
    q, k, v, w = (torch.randn(S, 1, h, d, generator=g, dtype=torch.float64).to(dtype).double()
                  for h, d in ((hq, dk), (hkv, dk), (hkv, dv), (hq, dv)))
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*ref_in, doc_ids, window=window)
    (ref * w).sum().backward()
    # zigzag's a2a and the ring move runs of a shard (planar); thd's a2a scattered rows (one fused buffer)
    combos = [("contiguous", "allgather")] if cp == 1 else [("zigzag", "a2a"), ("thd", "a2a"), ("balanced", "allgather")]
    results = {}
    rl.CALLS.clear()
    rl.GRAD_LAYOUTS.clear()
    with _hooks(kind):
        for layout, exchange in combos:
            try:
                state = bdcp.BlockDiagCPState.build(doc_ids, cp_group=group, layout=layout, kv_exchange=exchange,
                                                    attn_backend=_backend(kind), strict=strict)
                local = [state.shard(t).to(dtype).detach().requires_grad_() for t in (q, k, v)]
                with bdcp.blockdiag_cp_step(state):
                    o = bdcp.blockdiag_cp_attention(*local, softmax_scale=None,
                                                    window_size=None if window is None else (window, 0))
                    (o * state.shard(w).to(dtype)).sum().backward()
            except bdcp.BlockDiagCPError as exc:
                results[(layout, exchange)] = str(exc)
                continue
            report = state.report()
            errs = [_rel(o, state.shard(ref))] + [_rel(t.grad, state.shard(r.grad)) for t, r in zip(local, ref_in)]
            results[(layout, exchange)] = (errs, report["attn_backend"], report["attn_backend_reason"])
    return (results, sorted({c["kind"] for c in rl.CALLS}), sorted({c["window"] for c in rl.CALLS}),
            sorted({c["layout"] for c in rl.CALLS if "layout" in c}), sorted(set(rl.GRAD_LAYOUTS)))


# ---------------------------------------------------------------------------
# the matrix: one worker pair per library version
# ---------------------------------------------------------------------------


def _pool_key(kind, version):
    # flash-attn >= 2.7 registers its custom ops (flash_attn::...) in the process for good: one pair
    # of workers per such release; every other library is unloaded and reloaded in one shared pair.
    return f"{kind}-{version}" if kind == "flash-attn" and version >= "2.7" else "shared"


@pytest.fixture(scope="module")
def pools():
    made = {}

    def get(key):
        if key not in made:
            made[key] = WorkerPool(2)
        return made[key]

    yield get
    for pool in made.values():
        pool.close()


@pytest.fixture(scope="module", params=MATRIX, ids=[f"{k}-{v}" for k, v in MATRIX])
def release(request):
    kind, version = request.param
    reason = missing_reason(kind, version)
    if reason is not None:
        pytest.skip(reason)
    return kind, version


@pytest.fixture
def library(release, pools):
    """(kind, version, pool) with that release loaded in the pool's workers (the shared pool switches)."""
    kind, version = release
    pool = pools(_pool_key(kind, version))
    loaded = pool.run(w_load, kind, version, timeout=120)
    top = "flash_attn" if kind == "flash-attn" else "transformer_engine"
    assert all(top in names and all(n.startswith(top) or n.endswith("_torch") or n.endswith("_cuda")
                                    for n in names) for names in loaded), loaded  # only this library
    return kind, version, pool


@pytest.mark.timeout(180)
def test_kernel_pair_against_fp64_math(library):
    kind, version, pool = library
    if (kind, version) in REFUSED:
        pytest.skip(f"{kind} {version} is refused at backend resolution (test_old_releases_are_refused...)")
    for per_rank in pool.run(w_kernel_pair):
        for name, r in per_rank.items():
            if (kind, version) in NO_WINDOW and "window" in name:
                continue  # the engine never sends these a window (test_engine_...: falls back)
            assert isinstance(r, dict), (kind, version, name, r)
            assert "backward" not in r and len(r["errors"]) == 5, (kind, version, name, r)
            assert r["shapes_ok"] and r["window_reached"] and r["calls"] >= 1, (kind, version, name, r)
            assert max(r["errors"]) < TOL, (kind, version, name, r["errors"])


ENGINE_CASES = [  # case, window, (hq, hkv, dqk, dv)
    ("short", None, (4, 2, 8, 8)),  # many causal documents, grouped K/V heads
    ("single", 20, (4, 2, 12, 8)),  # one 64-token document, a window cut at chunk edges, MLA head dims
]


@pytest.mark.timeout(120)
def test_flash_custom_ops_fake_kernels_give_the_shapes_we_read(library):
    # flash-attn >= 2.7 registers fake (meta) kernels for its custom ops: its own shape functions.
    kind, version, pool = library
    if kind != "flash-attn" or version < "2.7":
        pytest.skip("no custom ops with fake kernels in this release")
    assert pool.run(w_meta_pair) == [META_SHAPES] * 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("case,window,heads", ENGINE_CASES, ids=["causal_gqa", "window_mla"])
def test_engine_streamed_op_against_the_reference(library, cp, case, window, heads):
    kind, version, pool = library
    backend = _backend(kind)
    for results, kinds, windows, layouts, grad_layouts in pool.run(w_engine, cp, case, window, heads):
        falls_back = (kind, version) in REFUSED or (window is not None and (kind, version) in NO_WINDOW)
        for key, r in results.items():
            assert isinstance(r, tuple), (kind, version, key, r)
            errs, got, reason = r
            assert max(errs) < TOL, (kind, version, key, errs)
            if falls_back:
                assert got != backend and reason.startswith("fell back"), (kind, version, key, got, reason)
            else:
                assert got == backend and "fell back" not in reason, (kind, version, key, got, reason)
        if falls_back:
            assert kinds == [], kinds  # the library was never called
        else:
            assert kinds == [{"te": "te"}.get(kind, "flash_attn")], kinds
            if window is not None:  # the engine narrows the window per call; some calls must get one
                assert any(left >= 0 for left, _ in windows), windows
            # A received chunk's K and V halves reach the kernel in place (no copy): TE as thd_th2d, flash by
            # their strides. The own keys are contiguous; MLA's unequal head dims always go apart.
            # dk / dv come back as one buffer's halves where K and V went in so, the chunk's gradient as it is
            expected = ["thd_th2d", "thd_thd_thd"] if cp > 1 and heads[2] == heads[3] else ["thd_thd_thd"]
            assert layouts == expected and grad_layouts == expected, (layouts, grad_layouts)


@pytest.mark.timeout(120)
def test_old_releases_are_refused_with_the_version_and_the_fix(library):
    kind, version, pool = library
    for ok, reason in pool.run(w_installed):
        if (kind, version) in REFUSED:
            assert not ok and version in reason and "upgrade" in reason, reason
        else:
            assert ok, reason
    if (kind, version) not in REFUSED:
        return
    for results, kinds, *_ in pool.run(w_engine, 2, "short", None, (4, 2, 8, 8), True):
        assert kinds == []
        for key, r in results.items():
            assert isinstance(r, str) and "strict mode" in r and version in r, (key, r)


@pytest.mark.timeout(120)
def test_window_fallback_names_the_missing_te_feature(library):
    kind, version, pool = library
    if (kind, version) not in NO_WINDOW:
        pytest.skip("this release takes bottom-right sliding windows")
    for results, *_ in pool.run(w_engine, 2, "single", 20, (4, 2, 8, 8)):
        for key, (_, got, reason) in results.items():
            assert got == "dense" and "bottom_right_diagonal" in reason, (key, got, reason)


# ---------------------------------------------------------------------------
# torch's own flash ops, as this torch registers them
# ---------------------------------------------------------------------------


@pytest.fixture
def torch_flash(pools):
    pool = pools("shared")
    assert pool.run(w_load, "torch", torch.__version__, timeout=120) == [[], []]  # no library loaded
    return pool


def test_our_torch_flash_calls_match_the_registered_schemas():
    from megatron_ext.blockdiag_cp import kernels

    fwd = torch.ops.aten._flash_attention_forward.default._schema
    bwd = torch.ops.aten._flash_attention_backward.default._schema
    names = {arg.name: arg.kwarg_only for arg in fwd.arguments}
    # What kernels.flash_forward / flash_backward pass by name must be keyword arguments of the schema.
    for name in ("scale", "window_size_left", "window_size_right"):
        assert names.get(name) is True, (name, fwd)
        assert {a.name: a.kwarg_only for a in bwd.arguments}.get(name) is True, (name, bwd)
    assert kernels._parameters(torch.ops.aten._flash_attention_forward)[:10] == (
        "query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal",
        "return_debug_mask")
    assert len(fwd.returns) == 5 and fwd.returns[1].name == "softmax_logsumexp"


def test_our_torch_flash_calls_run_through_torch_meta_kernels():
    # torch's own shape functions for aten::_flash_attention_forward/backward (torch/_meta_registrations):
    # the lse comes back [H, total_q] float32, and the gradients in q/k/v's shapes.
    from megatron_ext.blockdiag_cp import kernels
    from megatron_ext.testing import override_library

    with override_library("flash_attn", None):
        assert _meta_pair(kernels) == META_SHAPES


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("case,window,heads", ENGINE_CASES, ids=["causal_gqa", "window_mla"])
def test_engine_over_torch_flash_ops(torch_flash, cp, case, window, heads):
    for results, kinds, windows, layouts, grad_layouts in torch_flash.run(w_engine, cp, case, window, heads):
        for key, r in results.items():
            assert isinstance(r, tuple), (key, r)
            errs, got, reason = r
            assert got == "flash" and reason == "torch_varlen_attn importable", (key, got, reason)
            assert max(errs) < TOL, (key, errs)
        assert kinds == ["torch_flash"], kinds
        if window is not None:
            assert any(left >= 0 for left, _ in windows), windows
        assert layouts == (["thd_th2d", "thd_thd_thd"] if cp > 1 and heads[2] == heads[3] else ["thd_thd_thd"]), \
            layouts  # a received chunk's K and V halves go in by their strides
        assert grad_layouts == [], grad_layouts  # torch's ops allocate dk / dv themselves


@pytest.mark.timeout(120)
def test_kernel_pair_over_torch_flash_ops(torch_flash):
    for per_rank in torch_flash.run(w_kernel_pair):
        for name, r in per_rank.items():
            assert isinstance(r, dict) and "backward" not in r and len(r["errors"]) == 5, (name, r)
            assert r["shapes_ok"] and r["window_reached"] and max(r["errors"]) < TOL, (name, r)
