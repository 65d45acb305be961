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


# ---------------------------------------------------------------------------
# flash-attn >= 2.7's varlen calls are torch.library custom ops: their names live in the schema only
# ---------------------------------------------------------------------------


def _custom_op_flash_attn():
    """flash-attn 2.7+'s private varlen pair as custom ops of the same signatures (CPU math inside)."""
    import types
    from typing import Optional, Tuple

    from megatron_ext.testing.doubles import varlen_math, varlen_math_backward

    ns = "megatron_ext_test_kernels"
    if hasattr(torch.ops, ns) and hasattr(getattr(torch.ops, ns), "varlen_fwd"):
        return _custom_op_flash_attn.made

    def window(left, right, causal):
        assert right == (0 if causal else -1), (left, right, causal)
        return None if left < 0 else left

    @torch.library.custom_op(f"{ns}::varlen_fwd", mutates_args=(), device_types="cpu")
    def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
            cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
            softmax_scale: float, causal: bool, window_size_left: int = -1, window_size_right: int = -1,
            softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None, return_softmax: bool = False,
            block_table: Optional[torch.Tensor] = None, leftpad_k: Optional[torch.Tensor] = None,
            seqused_k: Optional[torch.Tensor] = None, zero_tensors: bool = False,
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        out, lse = varlen_math(q, k, v, cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), softmax_scale, causal,
                               window(window_size_left, window_size_right, causal))
        return out, lse.t().contiguous().float(), torch.empty(0), torch.zeros(2, dtype=torch.int64)

    @torch.library.custom_op(f"{ns}::varlen_bwd", mutates_args=("dq", "dk", "dv"), device_types="cpu")
    def bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
            dv: Optional[torch.Tensor], cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
            max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
            window_size_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor], deterministic: bool,
            rng_state: Optional[torch.Tensor] = None, zero_tensors: bool = False) -> torch.Tensor:
        grads = varlen_math_backward(dout, q, k, v, out, softmax_lse.t().to(q.dtype), cu_seqlens_q.tolist(),
                                     cu_seqlens_k.tolist(), softmax_scale, causal,
                                     window(window_size_left, window_size_right, causal))
        for dst, src in zip((dq, dk, dv), grads):
            dst.copy_(src)
        return torch.zeros(q.shape[1], q.shape[0])

    iface = types.SimpleNamespace(_flash_attn_varlen_forward=fwd, _flash_attn_varlen_backward=bwd)
    _custom_op_flash_attn.made = {"flash_attn": types.SimpleNamespace(__version__="2.8.3", flash_attn_interface=iface),
                                  "flash_attn.flash_attn_interface": iface}
    return _custom_op_flash_attn.made


def test_flash_attn_custom_ops_get_every_argument_by_its_schema_name():
    # inspect.signature of a CustomOpDef is (*args, **kwargs): the names must come from its schema, or
    # the window is silently dropped in forward and the backward misses its required arguments.
    from megatron_ext.testing import override_libraries
    from megatron_ext.testing.doubles import varlen_math_backward

    libraries = _custom_op_flash_attn()
    fwd = libraries["flash_attn.flash_attn_interface"]._flash_attn_varlen_forward
    assert "window_size_left" in kernels._parameters(fwd)
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(16, 2, 8, generator=g, dtype=torch.float64) for _ in range(4))
    seg = kernels.Segments(*(torch.tensor([0, 7, 16], dtype=torch.int32),) * 2, 9, 9, (7, 9), (7, 9), True, 3)
    with override_libraries(libraries):
        out, lse, aux = kernels.flash_forward(q, k, v, seg, 0.4)
        grads = kernels.flash_backward(dout, q, k, v, out, lse, aux, seg, 0.4)
    ref_out, ref_lse = varlen_math(q, k, v, [0, 7, 16], [0, 7, 16], 0.4, True, 3)
    ref_grads = varlen_math_backward(dout, q, k, v, ref_out, ref_lse, [0, 7, 16], [0, 7, 16], 0.4, True, 3)
    assert torch.allclose(out, ref_out, atol=1e-12) and torch.allclose(lse.double(), ref_lse, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        assert torch.allclose(got, want, atol=1e-5)
