"""Engine correctness on real gloo process groups (cp = 2 and 4) against the reference.

Every layout x exchange, on the document cases in cases.py, in float64: output and
gradients of q, k and v equal a single-process per-document causal reference.
"""

import pytest
import torch

from megatron_ext.testing import WorkerPool, reference_attention
from megatron_ext.testing.cases import CASES, make_doc_ids

LAYOUTS = ("contiguous", "zigzag", "balanced")
EXCHANGES = ("allgather", "halo", "a2a")
TOL = 1e-5


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _inputs(case, S, cp, b, hq, hkv, d):
    doc_ids = make_doc_ids(case, S, cp)
    S = doc_ids.shape[-1]  # "uneven" is shorter than asked: not a multiple of 2 * cp
    g = torch.Generator().manual_seed(7)
    q = torch.randn(S, b, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(S, b, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(S, b, hkv, d, generator=g, dtype=torch.float64)
    w = torch.randn(S, b, hq, d, generator=g, dtype=torch.float64)
    return doc_ids, q, k, v, w


def check_case(case, S, b, hq, hkv, d, layouts=LAYOUTS, exchanges=EXCHANGES, scale=None):
    """Runs on every rank; returns {(layout, exchange): (errors..., report)}."""
    import megatron_ext.blockdiag_cp as bdcp

    cp = torch.distributed.get_world_size()
    doc_ids, q, k, v, w = _inputs(case, S, cp, b, hq, hkv, d)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*ref_in, doc_ids, scale=scale)
    (ref * w).sum().backward()
    results = {}
    for layout in layouts:
        for exchange in exchanges:
            state = bdcp.BlockDiagCPState.build(doc_ids, layout=layout, kv_exchange=exchange,
                                                attn_backend="dense")
            local = [state.shard(t).detach().requires_grad_() for t in (q, k, v)]
            with bdcp.blockdiag_cp_step(state):
                out = bdcp.blockdiag_cp_attention(*local, softmax_scale=scale)
                (out * state.shard(w)).sum().backward()
            errs = [_rel(out, state.shard(ref))] + [
                _rel(t.grad, state.shard(r.grad)) for t, r in zip(local, ref_in)]
            results[(layout, exchange)] = (errs, state.report())
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"cp{n}")
def pool(request):
    p = WorkerPool(request.param)
    yield p
    p.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES)
def test_matches_reference_every_layout_and_exchange(pool, case):
    b = 2 if case == "b2" else 1
    results = pool.run(check_case, case, 96, b, 4, 2, 8)  # GQA: 4 query heads, 2 kv heads
    for rank, per_rank in enumerate(results):
        for (layout, exchange), (errs, report) in per_rank.items():
            assert max(errs) < TOL, (rank, layout, exchange, errs)
            assert report["layout"] == layout


@pytest.mark.timeout(300)
def test_batch_rows_share_doc_ids_without_gqa_and_custom_scale(pool):
    results = pool.run(check_case, "short", 64, 3, 3, 3, 4, LAYOUTS, EXCHANGES, 0.37)
    for per_rank in results:
        for key, (errs, _) in per_rank.items():
            assert max(errs) < TOL, (key, errs)
