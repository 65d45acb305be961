"""Sliding windows, attention sinks and MLA head dims under CP, against an fp64 reference.

Every layout x exchange (dense kernel) at cp 1, 2 and 3: output and every input
gradient (and the sink logits' gradient, summed over the CP ranks as Megatron's
gradient all-reduce does) equal ``reference_attention`` with the same window / sink
on one process. Windows smaller than, equal to and larger than documents, windows
reaching across rank boundaries, documents of length 1, sinks with windows, and a
value head dim different from the query/key one with grouped K/V heads.
"""

import pytest
import torch

from megatron_ext.testing import WorkerPool, pool_per_cp_fixture, reference_attention
from megatron_ext.testing.cases import make_doc_ids, runs_to_doc_ids

LAYOUTS = ("contiguous", "zigzag", "balanced")
EXCHANGES = ("allgather", "halo", "a2a")
TOL = 1e-9



pool = pool_per_cp_fixture([1, 2, 3])


def _rel(a, b):
    # Window 0 leaves each query its own key: dq and dk are rounding noise, so the floor is absolute.
    return float((a.detach() - b).abs().max() / b.abs().max().clamp_min(1e-3))


def check_variant(case, window, sink_kind, heads, kv_backwards=("refetch",), S=96, layouts=LAYOUTS):
    """On every rank: {(layout, exchange, kv_backward): [errors of out, dq, dk, dv, dsink]}."""
    import torch.distributed as dist

    import megatron_ext.blockdiag_cp as bdcp

    cp = dist.get_world_size()
    hq, hkv, dk, dv = heads
    doc_ids = make_doc_ids(case, S, cp)
    if layouts == ("thd",):
        doc_ids = _thd_padded(doc_ids, 2 * cp)
    b = doc_ids.shape[0] if doc_ids.dim() == 2 else 1
    S = doc_ids.shape[-1]
    g = torch.Generator().manual_seed(17)
    q = torch.randn(S, b, hq, dk, generator=g, dtype=torch.float64)
    k = torch.randn(S, b, hkv, dk, generator=g, dtype=torch.float64)
    v = torch.randn(S, b, hkv, dv, generator=g, dtype=torch.float64)
    w = torch.randn(S, b, hq, dv, generator=g, dtype=torch.float64)
    sink = None if sink_kind is None else (
        torch.zeros(hq, dtype=torch.float64) if sink_kind == "off-by-one"
        else torch.randn(hq, generator=g, dtype=torch.float64))
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_sink = None if sink is None else sink.clone().requires_grad_(sink_kind == "learnable")
    ref = reference_attention(*ref_in, doc_ids, window=window, sink=ref_sink)
    (ref * w).sum().backward()
    results = {}
    for layout in layouts:
        for exchange in EXCHANGES:
            for kv_backward in kv_backwards:
                state = bdcp.BlockDiagCPState.build(doc_ids, layout=layout, kv_exchange=exchange,
                                                    attn_backend="dense", kv_backward=kv_backward)
                local = [state.shard(t).detach().requires_grad_() for t in (q, k, v)]
                offset = None if sink is None else sink.clone().requires_grad_(sink_kind == "learnable")
                with bdcp.blockdiag_cp_step(state):
                    out = bdcp.blockdiag_cp_attention(
                        *local, window_size=None if window is None else (window, 0), softmax_offset=offset)
                    (out * state.shard(w)).sum().backward()
                errs = [_rel(out, state.shard(ref))] + [
                    _rel(t.grad, state.shard(r.grad)) for t, r in zip(local, ref_in)]
                if sink_kind == "learnable":
                    grad = offset.grad.clone()
                    dist.all_reduce(grad)  # every rank's queries contribute (Megatron reduces over DP x CP)
                    errs.append(_rel(grad, ref_sink.grad))
                results[(layout, exchange, kv_backward)] = errs
    return results


def _thd_padded(doc_ids, multiple):
    """[S] ids -> every document followed by padding (id 0) to a multiple of ``multiple`` tokens, as
    Megatron's THD packing pads each sequence to 2 * cp (``cu_seqlens_padded``)."""
    ids, parts, start = doc_ids.tolist(), [], 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or ids[end] != ids[start]:
            run = ids[start:end]
            if run[0] != 0:
                parts += run + [0] * (-len(run) % multiple)
            start = end
    return torch.tensor(parts, dtype=torch.long)


def _assert_all(results):
    for rank, per_rank in enumerate(results):
        for key, errs in per_rank.items():
            assert max(errs) < TOL, (rank, key, errs)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["single", "short", "len1_boundaries", "pad_middle", "b2"])
@pytest.mark.parametrize("window", [0, 5, 23, 200])
def test_sliding_window(pool, case, window):
    # short documents are 1-12 tokens: window 5 cuts some, 23 and 200 none; single: every window cuts
    # across rank boundaries (S = 96); len1_boundaries puts length-1 documents at every shard boundary.
    modes = ("refetch", "save") if window == 23 else ("refetch",)
    _assert_all(pool.run(check_variant, case, window, None, (4, 2, 8, 8), modes))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("sink", ["off-by-one", "learnable"])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("case", ["single", "short", "pad_middle"])
def test_attention_sinks(pool, sink, window, case):
    _assert_all(pool.run(check_variant, case, window, sink, (4, 2, 8, 8)))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["single", "short", "b2"])
def test_mla_head_dims_with_grouped_kv(pool, case):
    # q/k head dim 12, v head dim 8 (DeepSeek-V3's 192/128 in small), 4 query heads over 2 K/V heads.
    _assert_all(pool.run(check_variant, case, None, None, (4, 2, 12, 8), ("refetch", "save")))
    _assert_all(pool.run(check_variant, case, 9, "learnable", (4, 4, 6, 10)))  # wider V, window, sink


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["single", "short", "len1_boundaries"])
def test_variants_on_the_thd_layout(pool, case):
    # TE's per-document partition (Megatron's --sft packing): window, learnable sink, MLA head dims.
    _assert_all(pool.run(check_variant, case, 7, "learnable", (4, 2, 12, 8), ("refetch", "save"), 96, ("thd",)))


def test_window_size_must_be_causal():
    import megatron_ext.blockdiag_cp as bdcp

    state = bdcp.BlockDiagCPState.build(torch.ones(8, dtype=torch.long), attn_backend="dense")
    q = torch.randn(8, 1, 2, 4)
    for bad, needle in (((4, 2), "right must be 0"), ((-3, 0), "left >= 0"), ("x", "pair")):
        with pytest.raises(bdcp.BlockDiagCPError, match=needle):
            with bdcp.blockdiag_cp_step(state):
                bdcp.blockdiag_cp_attention(q, q, q, window_size=bad)
    with pytest.raises(bdcp.BlockDiagCPError, match="softmax_offset has shape"):
        with bdcp.blockdiag_cp_step(state):
            bdcp.blockdiag_cp_attention(q, q, q, softmax_offset=torch.zeros(3))


# ---------------------------------------------------------------------------
# the flash and TE argument plumbing through the library doubles (megatron_ext.testing.doubles)
# ---------------------------------------------------------------------------


def _libraries(setup):
    from megatron_ext.testing import doubles as fd

    if setup == "flash_attn":
        lib, iface = fd.fake_flash_attn("2.8.3")
        return "flash", {"flash_attn": lib, "flash_attn.flash_attn_interface": iface}
    if setup in ("torch_flash", "torch_flash_no_window"):
        return "flash", {"flash_attn": None, "torch.nn.attention.varlen": object(),
                         "torch.ops.aten.flash": fd.fake_torch_flash_ops(window=setup == "torch_flash")}
    return "te", fd.fake_te("2.14.0" if setup == "te_2_14" else "2.15.0")


def check_through_double(setup, window, sink_kind, heads, strict=False, runs=None):
    """One step per layout x exchange with a backend's library double behind it; errors and backends.
    ``runs``: the documents as (id, length) runs of 96 tokens (default: one document)."""
    import torch.distributed as dist

    import megatron_ext.blockdiag_cp as bdcp
    from megatron_ext.testing import doubles as fd
    from megatron_ext.testing import override_availability, override_libraries

    backend, libraries = _libraries(setup)
    hq, hkv, dk, dv = heads
    doc_ids = make_doc_ids("single", 96, dist.get_world_size()) if runs is None else runs_to_doc_ids(runs)
    g = torch.Generator().manual_seed(3)
    q, k, v, w = (torch.randn(96, 1, h, d, generator=g, dtype=torch.float64)
                  for h, d in ((hq, dk), (hkv, dk), (hkv, dv), (hq, dv)))
    sink = None if sink_kind is None else torch.randn(hq, generator=g, dtype=torch.float64)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    (reference_attention(*ref_in, doc_ids, window=window, sink=sink) * w).sum().backward()
    out = {}
    fd.CALLS.clear()
    with override_libraries(libraries), override_availability(backend, None, any_call=True):
        for layout in LAYOUTS:
            for exchange in ("allgather", "a2a"):
                state = bdcp.BlockDiagCPState.build(doc_ids, layout=layout, kv_exchange=exchange,
                                                    attn_backend=backend, strict=strict)
                local = [state.shard(t).detach().requires_grad_() for t in (q, k, v)]
                try:
                    with bdcp.blockdiag_cp_step(state):
                        o = bdcp.blockdiag_cp_attention(*local, window_size=None if window is None else (window, 0),
                                                        softmax_offset=sink)
                        (o * state.shard(w)).sum().backward()
                except bdcp.BlockDiagCPError as exc:
                    out[(layout, exchange)] = str(exc)
                    continue
                errs = [_rel(t.grad, state.shard(r.grad)) for t, r in zip(local, ref_in)]
                out[(layout, exchange)] = (errs, state.report()["attn_backend"], state.report()["attn_backend_reason"])
    windows = {c.get("window") for c in fd.CALLS}
    return out, sorted(windows, key=str), sorted({c["kind"] for c in fd.CALLS})


@pytest.fixture(scope="module")
def pool2():
    p = WorkerPool(2)
    yield p
    p.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("setup", ["flash_attn", "torch_flash", "te", "te_2_14"])
def test_windows_sinks_and_mla_through_the_library_doubles(pool2, setup):
    # window 20 over one 96-token document at cp = 2: bands cut at chunk edges, windowed diagonals.
    for out, windows, kinds in pool2.run(check_through_double, setup, 20, "learnable", (4, 2, 12, 8)):
        assert kinds == [{"flash_attn": "flash_attn", "torch_flash": "torch_flash"}.get(setup, "te")], kinds
        assert any(w not in (None,) for w in windows), windows  # windows reached the library
        for key, (errs, backend, _) in out.items():
            assert backend == ("te" if setup.startswith("te") else "flash"), (key, backend)
            assert max(errs) < 1e-5, (key, errs)  # the libraries hand the lse back in fp32


@pytest.mark.timeout(300)
@pytest.mark.parametrize("setup", ["flash_attn", "torch_flash"])
def test_flash_window_bands_with_more_queries_than_keys(pool2, setup):
    # Documents that start a few tokens before a zigzag chunk edge (cp 2: chunks of 24): the other
    # rank's first 20 queries see 3 (and 12) of their keys through a band. flash opens a window's right
    # edge only max_seqlen_k past each segment's bottom-right diagonal (flash_api.cpp), so with
    # max_seqlen_k = 3 the band's first 16 queries would see no key: lse +inf, NaN once merged (an
    # H200 showed it through torch's flash ops). The doubles apply flash's edges and its +inf.
    runs = [(1, 21), (2, 39), (3, 36)]
    for out, windows, kinds in pool2.run(check_through_double, setup, 20, None, (4, 2, 8, 8), False, runs):
        assert kinds == [setup], kinds
        for key, (errs, backend, _) in out.items():
            assert backend == "flash", (key, backend)
            assert max(errs) < 1e-5, (key, errs)


@pytest.mark.timeout(300)
def test_flash_without_window_support_falls_back_or_raises_in_strict(pool2):
    for out, _, kinds in pool2.run(check_through_double, "torch_flash_no_window", 20, None, (4, 2, 8, 8)):
        assert kinds == [], kinds  # the library was never called with a window it cannot take
        for key, (errs, backend, reason) in out.items():
            assert backend == "dense" and "take no sliding window" in reason, (key, backend, reason)
            assert max(errs) < TOL
    for out, _, _ in pool2.run(check_through_double, "torch_flash_no_window", 20, None, (4, 2, 8, 8), True):
        assert all(isinstance(r, str) and "strict mode" in r and "sliding window" in r for r in out.values()), out
