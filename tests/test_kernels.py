"""The kernels' forward/backward contract with the log-sum-exp, on CPU (dense's two paths).

A query's keys split over two calls (a full call over earlier keys, a causal call on
the diagonal), merged by their log-sum-exp, equal one attention over all keys; each
call's backward, given the *merged* output and lse, returns exactly its share of the
gradients. Checked against autograd through an explicit masked softmax (the test
doubles' math), for torch's CPU flash kernel and the blockwise math path, with GQA
and with a value head dim that differs from the query/key one (MLA).
"""

import pytest
import torch

from megatron_ext.blockdiag_cp import kernels
from megatron_ext.testing.doubles import varlen_math


def _segments(q_lens, k_lens, causal):
    cu = lambda lens: torch.tensor((0,) + tuple(lens)).cumsum(0).to(torch.int32)  # noqa: E731
    return kernels.Segments(cu(q_lens), cu(k_lens), max(q_lens), max(k_lens), tuple(q_lens), tuple(k_lens),
                            causal)


@pytest.fixture(params=["cpu_flash", "math"])
def path(request, monkeypatch):
    if request.param == "math":  # what CUDA tensors and dropout take
        monkeypatch.setattr(kernels, "_cpu_flash_usable", lambda q, v, p: False)
        monkeypatch.setattr(kernels, "_MATH_BLOCK_BUDGET", 64)  # several query blocks per segment
    return request.param


@pytest.mark.parametrize("hq,hkv,dk,dv", [(4, 2, 8, 8), (2, 2, 6, 4), (4, 1, 4, 10)])
def test_two_calls_merged_by_lse_equal_one_attention(path, hq, hkv, dk, dv):
    g = torch.Generator().manual_seed(0)
    # Two documents: 5 earlier keys + 7 diagonal positions, and 3 earlier keys + 4 diagonal ones.
    early, diag = (5, 3), (7, 4)
    q = torch.randn(sum(diag), hq, dk, generator=g, dtype=torch.float64)
    k_early, k_diag = (torch.randn(n, hkv, dk, generator=g, dtype=torch.float64) for n in (sum(early), sum(diag)))
    v_early, v_diag = (torch.randn(n, hkv, dv, generator=g, dtype=torch.float64) for n in (sum(early), sum(diag)))
    dout = torch.randn(sum(diag), hq, dv, generator=g, dtype=torch.float64)
    scale = 0.37

    full, causal = _segments(diag, early, False), _segments(diag, diag, True)
    o1, l1, a1 = kernels.dense_forward(q, k_early, v_early, full, scale)
    o2, l2, a2 = kernels.dense_forward(q, k_diag, v_diag, causal, scale)
    lse = torch.logaddexp(l1, l2)
    out = o1 * torch.exp(l1 - lse).unsqueeze(-1) + o2 * torch.exp(l2 - lse).unsqueeze(-1)
    g1 = kernels.dense_backward(dout, q, k_early, v_early, out, lse, a1, full, scale)
    g2 = kernels.dense_backward(dout, q, k_diag, v_diag, out, lse, a2, causal, scale)

    # Reference: autograd through explicit attention of each document over its keys.
    leaves = [t.clone().requires_grad_() for t in (q, k_early, k_diag, v_early, v_diag)]
    rq, rke, rkd, rve, rvd = leaves
    outs, lses, qa, ea, da = [], [], 0, 0, 0
    rep = hq // hkv
    for ne, nd in zip(early, diag):
        ks = torch.cat([rke[ea:ea + ne], rkd[da:da + nd]]).repeat_interleave(rep, 1)
        vs = torch.cat([rve[ea:ea + ne], rvd[da:da + nd]]).repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", rq[qa:qa + nd], ks) * scale
        mask = torch.ones(nd, ne + nd, dtype=torch.bool)
        mask[:, ne:] = torch.ones(nd, nd, dtype=torch.bool).tril()
        s = s.masked_fill(~mask, float("-inf"))
        lses.append(torch.logsumexp(s, -1).t())
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vs))
        qa, ea, da = qa + nd, ea + ne, da + nd
    ref = torch.cat(outs)
    ref.backward(dout)
    assert torch.allclose(out, ref, atol=1e-12) and torch.allclose(lse, torch.cat(lses), atol=1e-12)
    assert torch.allclose(g1[0] + g2[0], rq.grad, atol=1e-12)
    for got, leaf in ((g1[1], rke), (g2[1], rkd), (g1[2], rve), (g2[2], rvd)):
        assert torch.allclose(got, leaf.grad, atol=1e-12)


def test_dense_forward_matches_the_doubles_math_and_lse_dtypes():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(9, 4, 8, generator=g)
    k, v = torch.randn(9, 2, 8, generator=g), torch.randn(9, 2, 8, generator=g)
    seg = _segments((4, 5), (4, 5), True)
    out, lse, _ = kernels.dense_forward(q, k, v, seg, 0.5)
    ref_out, ref_lse = varlen_math(q, k, v, [0, 4, 9], [0, 4, 9], 0.5, True)
    assert torch.allclose(out, ref_out, atol=1e-5) and torch.allclose(lse, ref_lse, atol=1e-5)
    assert lse.dtype == torch.float32
    assert kernels.dense_forward(q.double(), k.double(), v.double(), seg, 0.5)[1].dtype == torch.float64


def test_dense_dropout_replays_its_masks_from_the_seed():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(6, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    seg = _segments((6,), (6,), True)
    a = kernels.dense_forward(q, k, v, seg, 0.5, dropout_p=0.4, seed=7)
    b = kernels.dense_forward(q, k, v, seg, 0.5, dropout_p=0.4, seed=7)
    c = kernels.dense_forward(q, k, v, seg, 0.5, dropout_p=0.4, seed=8)
    clean = kernels.dense_forward(q, k, v, seg, 0.5)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])
    assert torch.allclose(a[1], clean[1], atol=1e-12)  # the lse is the undropped softmax's normalizer
