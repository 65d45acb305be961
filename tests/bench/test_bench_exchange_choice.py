"""scripts/bench/exchange_choice.py: the ulysses bytes the bench prices are the engine's.

``ulysses_forward_bytes`` (the analytic all-to-all volume of the exchange_choice suite) against
``state.report()["bytes_sent"]`` / ``["bytes_received"]`` of a real ulysses call on a gloo group
at cp 2, with the K/V head repeated (Hkv 1 < cp), MLA-style head dims and b = 2, so the bench
cannot drift from the code; the link split adds up to the same bytes; the suite's rows at a
small point carry that figure and refuse a cp that does not divide the query heads, and the 2-D rows
are the library's pricing and compete in ``choices``.
"""

import os
import sys

import pytest
import torch

from megatron_ext.testing import WorkerPool

BENCH_SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                             "scripts", "bench")
B, HQ, HKV, DQK, DV = 2, 4, 1, 8, 4


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, BENCH_SCRIPTS)
    try:
        import exchange_choice

        yield exchange_choice
    finally:
        sys.path.remove(BENCH_SCRIPTS)


def ulysses_step(dtype_name: str):
    """On every rank: one ulysses forward + backward over a short-document pack; the report's bytes."""
    import megatron_ext.blockdiag_cp as bdcp

    dtype = getattr(torch, dtype_name)
    lengths = [37, 5, 60, 18, 3, 29]
    doc_ids = torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))
    state = bdcp.BlockDiagCPState.build(doc_ids, layout="balanced", kv_exchange="ulysses", attn_backend="dense")
    g = torch.Generator().manual_seed(state.rank)
    q, k, v = (torch.randn(state.local_len, B, h, d, generator=g).to(dtype).requires_grad_()
               for h, d in ((HQ, DQK), (HKV, DQK), (HKV, DV)))
    with bdcp.blockdiag_cp_step(state):
        bdcp.blockdiag_cp_attention(q, k, v).float().sum().backward()
    rep = state.report()
    return {"kv_exchange": rep["kv_exchange"], "local_len": rep["local_len"], "cp": rep["cp"],
            "bytes_sent": rep["bytes_sent"], "bytes_received": rep["bytes_received"],
            "element_size": q.element_size()}


@pytest.mark.timeout(180)
def test_ulysses_bytes_are_the_engines_report(bench):
    with WorkerPool(2) as pool:
        for dtype_name in ("float32", "bfloat16"):
            for rank, r in enumerate(pool.run(ulysses_step, dtype_name, timeout=120)):
                assert r["kv_exchange"] == "ulysses", r
                moved, repeats, refused = bench.ulysses_forward_bytes(
                    r["local_len"], B, HQ, HKV, DQK, DV, r["element_size"], r["cp"])
                assert (refused, repeats) == ("", 2)
                assert r["bytes_sent"] == r["bytes_received"] == moved, (dtype_name, rank, r, moved)


def test_link_split_adds_up_to_the_forward_bytes(bench):
    for cp, per_node in ((8, 0), (64, 8), (16, 8)):
        moved, repeats, refused = bench.ulysses_forward_bytes(16384, 1, 64, 8, 128, 128, 2, cp)
        assert not refused
        intra, inter = bench.ulysses_link_bytes(16384, 64, 8, 128, 2, cp, repeats, per_node)
        assert intra + inter == pytest.approx(moved, rel=1e-12)
        assert inter == (0 if per_node == 0 else pytest.approx(moved * (cp - per_node) / (cp - 1)))


def test_rows_at_a_small_point(bench):
    rows = bench.run(points=(("4k / cp 2", 4096, 2, "nvlink", ("llama3_8b",)),
                             ("64k / cp 64", 65536, 64, "2lvl", ("llama3_8b",))),
                     mixes=("short",), log=lambda *_: None)
    uly = {r["cp"]: r for r in rows if r["exchange"] == "ulysses"}
    assert uly[2]["bytes_max"] == bench.ulysses_forward_bytes(2048, 1, 32, 8, 128, 128, 2, 2)[0]
    assert uly[2]["modeled_seconds"] > uly[2]["ideal_seconds"] and "refused" not in uly[2]
    assert "32 query heads over the cp=64 ranks" in uly[64]["refused"]
    picks = bench.choices(rows)
    # short documents: a needed-only exchange is modeled fastest (ulysses moves every q/k/v/out block)
    assert [set(p["pick"].split(" = ")) <= {"a2a", "hierarchical"} for p in picks] == [True, True], picks


def test_2d_rows_compete(bench):
    # 32k / cp 8 on one node: u 2 and 4 with outer a2a, each on both layouts, priced by the library;
    # one document of the pack: the best 2-D option beats a2a's every-key exchange and is named.
    from megatron_ext.blockdiag_cp.cost_options import price_option

    rows = bench.run(points=(("32k / cp 8", 32768, 8, "nvlink", ("llama3_8b",)),), mixes=("single",),
                     log=lambda *_: None)
    two_d = [r for r in rows if r["exchange"] == "2d"]
    assert sorted((r["option"], r["layout"]) for r in two_d) == sorted(
        (f"2d u{u} x r{8 // u} a2a", lay) for u in (2, 4) for lay in bench.LAYOUTS)
    r = next(r for r in two_d if r["option"] == "2d u4 x r2 a2a" and r["layout"] == "zigzag")
    o = price_option(torch.ones(32768, dtype=torch.long), 8, "zigzag", "a2a", 4, bench.MODELS["llama3_8b"])
    # on cost.py's terms, as the 1-D rows: the planned price without its merges
    assert (r["bytes_max"], r["modeled_seconds"], r["merge_seconds"]) == (
        o.bytes_max, o.modeled_seconds - o.merge_seconds, o.merge_seconds)
    assert o.merge_seconds > 0
    (pick,) = bench.choices(rows)
    assert pick["by"]["2d"]["modeled_seconds"] < pick["by"]["a2a"]["modeled_seconds"], pick
    assert "2d" not in pick["pick"].split(" = ")  # a 2-D pick is named by its option
