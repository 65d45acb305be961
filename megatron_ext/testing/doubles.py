"""Test doubles for the flash and TE kernels: plain-torch math behind their call contracts, with lse.

What these doubles test: OUR side of the contract -- the metadata the engine
hands a varlen kernel (cu_seqlens, max_seqlen, dtypes, devices, strides, head
counts, the causal flag of each call, the keyword arguments and their spelling,
the log-sum-exp layouts each library returns and takes back in backward) and the
plumbing around the call (chunks, GQA head order, the transfers feeding the keys,
merging partial outputs). They run on CPU in fp32/fp64.

What they do NOT test: the real CUDA kernels (flash-attn, torch's flash ops,
TransformerEngine's fused attention), their numerics in bf16, or whether a given
GPU/driver/library version accepts the call. The GPU check
(``scripts/gpu_check.sh``) does that on a GPU machine. The library doubles spell
flash-attn >= 2.7's private varlen calls and TE's fused_attn as 2.8-2.14 or 2.15+ spell it;
every release the kernels support runs its own Python code in
tests/engine/test_real_libraries.py (emulated C++ extensions only).

Every double computes, per segment i, softmax(q_i k_i^T * scale) v_i over
q[cu_q[i]:cu_q[i+1]] and k/v[cu_k[i]:cu_k[i+1]], causal (square, on the diagonal)
or full as the call says, GQA by repeat_interleave of the K/V heads, and returns
the log-sum-exp in the library's layout; its backward takes the (final) output and
log-sum-exp it is given, as the real kernels do -- explicit math, sharing no code
with megatron_ext's dense kernel.
"""

import types
from typing import List

import torch


class ContractError(AssertionError):
    """The engine called a kernel double with metadata a real kernel would reject or misread."""


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ContractError(message)


def check_varlen_metadata(q, k, v, cu_q, cu_k, max_q, max_k, causal: bool, round_to: int = 1,
                          same_head_dim: bool = False, k_bound: bool = False) -> tuple:
    """Validate what a real varlen kernel relies on; return host copies of cu_seqlens.

    ``same_head_dim``: the kernel takes one head dim for q, k and v (flash). ``k_bound``: max_seqlen_k
    may exceed the longest key segment (flash reads it as a bound; the engine widens it for windows).
    """
    _check(q.dim() == 3 and k.dim() == 3 and v.dim() == 3, f"q/k/v must be [T, H, D]: {q.shape} {k.shape}")
    _check(k.shape[:2] == v.shape[:2], f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in rows/heads")
    _check(q.shape[2] == k.shape[2], "q and k head dims differ")
    _check(not same_head_dim or v.shape[2] == q.shape[2], f"flash takes one head dim: q {q.shape}, v {v.shape}")
    _check(q.shape[1] % k.shape[1] == 0, f"Hq={q.shape[1]} not a multiple of Hkv={k.shape[1]}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check(t.stride(-1) == 1, f"{name} must have a contiguous last dimension (stride {t.stride()})")
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        _check(isinstance(cu, torch.Tensor), f"{name} must be a tensor")
        _check(cu.dtype == torch.int32, f"{name} must be int32, got {cu.dtype}")
        _check(cu.device == q.device, f"{name} on {cu.device}, q on {q.device}")
        _check(cu.dim() == 1, f"{name} must be 1-D")
    _check(cu_q.numel() == cu_k.numel(), "cu_seqlens_q and cu_seqlens_k have different segment counts")
    _check(cu_q.numel() >= 2, "called with zero segments (the engine must not call a kernel with no work)")
    cq, ck = cu_q.tolist(), cu_k.tolist()
    _check(cq[0] == 0 and ck[0] == 0, "cu_seqlens must start at 0")
    _check(cq[-1] == q.shape[0], f"cu_seqlens_q[-1]={cq[-1]} but q has {q.shape[0]} rows")
    _check(ck[-1] == k.shape[0], f"cu_seqlens_k[-1]={ck[-1]} but k has {k.shape[0]} rows")
    nq = [b - a for a, b in zip(cq[:-1], cq[1:])]
    nk = [b - a for a, b in zip(ck[:-1], ck[1:])]
    _check(min(nq) >= 1 and min(nk) >= 1, "empty segments (every segment needs a query and a key)")
    if causal:
        _check(nq == nk, "a causal call's segments must be square (queries and keys the same positions)")
    want_q, want_k = max(nq), max(nk)
    if round_to > 1:
        want_q, want_k = -(-want_q // round_to) * round_to, -(-want_k // round_to) * round_to
    _check(int(max_q) == want_q, f"max_seqlen_q={max_q}, expected {want_q}")
    _check(int(max_k) == want_k or (k_bound and int(max_k) >= want_k),
           f"max_seqlen_k={max_k}, expected {want_k}{' or more' if k_bound else ''}")
    return cq, ck


def _segment_scores(qs, ks, scale, causal, window=None, right=None):
    scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
    nq, nk = qs.shape[0], ks.shape[0]
    i, j = torch.arange(nq).unsqueeze(1), torch.arange(nk).unsqueeze(0)
    hidden = torch.zeros(nq, nk, dtype=torch.bool)
    if causal:
        hidden |= j > i
    if window is not None and window >= 0:  # flash's bottom-right sliding window
        hidden |= j < i + nk - nq - window
    if right is not None:  # a right edge measured from the bottom-right diagonal too
        hidden |= j > i + nk - nq + right
    return scores.masked_fill(hidden.to(scores.device), float("-inf"))


def varlen_math(q, k, v, cq: List[int], ck: List[int], scale: float, causal: bool, window=None, right=None,
                empty_lse: float = float("-inf")):
    """(out [T, Hq, Dv], lse [T, Hq]): explicit per-segment softmax attention. A query that sees no key
    gets out 0 and lse ``empty_lse`` (flash-attn's kernels write +inf there)."""
    rep = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for i in range(len(cq) - 1):
        qs = q[cq[i]:cq[i + 1]]
        ks = k[ck[i]:ck[i + 1]].repeat_interleave(rep, dim=1)
        vs = v[ck[i]:ck[i + 1]].repeat_interleave(rep, dim=1)
        scores = _segment_scores(qs, ks, scale, causal, window, right)
        lse = torch.logsumexp(scores, dim=-1)  # [H, n]
        probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
        outs.append(torch.einsum("hqk,khd->qhd", probs, vs))
        lses.append(lse.masked_fill(lse == float("-inf"), empty_lse).t())
    return torch.cat(outs), torch.cat(lses)


def varlen_math_backward(dout, q, k, v, out, lse, cq, ck, scale, causal, window=None, right=None):
    """(dq, dk, dv) of this call, given the final out [T, Hq, Dv] and lse [T, Hq]."""
    rep = q.shape[1] // k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for i in range(len(cq) - 1):
        a, b, c, e = cq[i], cq[i + 1], ck[i], ck[i + 1]
        ks, vs = k[c:e].repeat_interleave(rep, dim=1), v[c:e].repeat_interleave(rep, dim=1)
        probs = torch.exp(_segment_scores(q[a:b], ks, scale, causal, window, right)
                          - lse[a:b].t().unsqueeze(-1)).nan_to_num(0.0)
        d_probs = torch.einsum("qhd,khd->hqk", dout[a:b], vs)
        delta = (dout[a:b] * out[a:b]).sum(-1).t().unsqueeze(-1)  # [H, n, 1]
        d_scores = probs * (d_probs - delta) * scale
        dq[a:b] = torch.einsum("hqk,khd->qhd", d_scores, ks)
        dk[c:e] = torch.einsum("hqk,qhd->khd", d_scores, q[a:b]).unflatten(1, (-1, rep)).sum(2)
        dv[c:e] = torch.einsum("hqk,qhd->khd", probs, dout[a:b]).unflatten(1, (-1, rep)).sum(2)
    return dq, dk, dv


TE_THD_LAYOUTS = ("thd_thd_thd", "thd_th2d")


def te_layout_reads(q, k, v, layout: str):
    """q, k, v [t, h, d] as TE's C++ reads them: from each data pointer, with the strides the layout
    says, whatever strides the torch tensors carry (``thd_th2d``: K and V interleaved per head)."""
    _check(layout in TE_THD_LAYOUTS, f"qkv_layout {layout!r}: the engine passes {TE_THD_LAYOUTS}")
    def read(t, interleave):  # [t, h, d], each row of h heads and each head `interleave` times d apart
        return t.as_strided(t.shape, (interleave * t.shape[1] * t.shape[2], interleave * t.shape[2], 1))

    kv = 1 if layout == "thd_thd_thd" else 2
    _check(kv == 1 or k.shape == v.shape, f"thd_th2d takes k and v of one shape: {tuple(k.shape)}, {tuple(v.shape)}")
    return read(q, 1), read(k, kv), read(v, kv)


def te_layout_grads(dq, dk, dv, layout: str):
    """dq, dk, dv as TE's C++ allocates them for ``layout``: with ``thd_th2d`` dk and dv are the halves
    of one [t, h, 2, d] buffer."""
    _check(layout in TE_THD_LAYOUTS, f"dqkv_layout {layout!r}: the engine passes {TE_THD_LAYOUTS}")
    if layout == "thd_thd_thd":
        return dq, dk, dv
    dkv = torch.stack([dk, dv], dim=2)  # [t, h, 2, d]
    return dq, dkv[:, :, 0], dkv[:, :, 1]


CALLS: List[dict] = []  # metadata of every double call in this process (tests read and clear it)


def _record(kind, q, k, cq, causal, **extra):
    CALLS.append({"kind": kind, "segments": len(cq) - 1, "hq": q.shape[1], "hkv": k.shape[1],
                  "causal": causal, **extra})


# ---------------------------------------------------------------------------
# engine-level double: stands in for a backend's kernel pair (override_kernel(backend, KERNEL_DOUBLE))
# ---------------------------------------------------------------------------


def _double_forward(q, k, v, seg, softmax_scale, dropout_p=0.0, seed=0):
    _check(dropout_p == 0.0, "the double has no dropout")
    cq, ck = check_varlen_metadata(q, k, v, seg.cu_seqlens_q, seg.cu_seqlens_k, seg.max_seqlen_q,
                                   seg.max_seqlen_k, seg.causal)
    _check(list(seg.q_lens) == [b - a for a, b in zip(cq[:-1], cq[1:])], "host q_lens disagree with cu_seqlens_q")
    _check(list(seg.k_lens) == [b - a for a, b in zip(ck[:-1], ck[1:])], "host k_lens disagree with cu_seqlens_k")
    _record("kernel", q, k, cq, seg.causal, window=seg.window)
    out, lse = varlen_math(q, k, v, cq, ck, softmax_scale, seg.causal, seg.window)
    return out, lse, ("double", len(cq))


def _double_backward(dout, q, k, v, out, lse, aux, seg, softmax_scale, dropout_p=0.0):
    _check(aux[0] == "double" and aux[1] == seg.cu_seqlens_q.numel(), "backward got another call's aux")
    _check(out.shape[:2] == q.shape[:2] and lse.shape == q.shape[:2], "out/lse rows differ from q's")
    return varlen_math_backward(dout, q, k, v, out, lse, seg.cu_seqlens_q.tolist(), seg.cu_seqlens_k.tolist(),
                                softmax_scale, seg.causal, seg.window)


def kernel_double():
    """A ``kernels.Kernel`` made of the explicit math above (for ``override_kernel``)."""
    from megatron_ext.blockdiag_cp.kernels import Kernel

    return Kernel(_double_forward, _double_backward)


# ---------------------------------------------------------------------------
# library-level doubles: what kernels.flash_forward / te_forward call
# ---------------------------------------------------------------------------


def _rng_state(device):
    return torch.zeros(2, dtype=torch.int64, device=device)


def _flash_edges(left, right, causal, max_k):
    """flash's (left, right) -> the (window, right) edges its kernels apply, as flash-attn 2's C++ derives
    them (flash_api.cpp): a window at least max_seqlen_k wide is none, causal is right = 0, and a window's
    open right edge becomes max_seqlen_k past each segment's bottom-right diagonal. A right edge other
    than the causal or the open one is a misuse."""
    left = -1 if left is None else left
    right = -1 if right is None else right
    _check(right == (0 if causal else -1) or (left == -1 and right == -1),
           f"window right edge {right} with causal={causal}")
    _check(left >= -1, f"window left edge {left}: flash reads any negative edge as no window")
    left = -1 if left >= max_k else left
    if left < 0:
        return None, None
    return left, (None if causal else int(max_k))


def fake_torch_flash_ops(window: bool = True):
    """Stands in for ``torch.ops.aten._flash_attention_forward/_backward`` (varlen: lse [H, T]).

    ``window=False``: an older torch whose ops take no window_size_left/right.
    """
    ops = _torch_flash_ops_with_window()
    if window:
        return ops

    def forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                return_debug_mask, *, scale=None):
        return ops._flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                                            is_causal, return_debug_mask, scale=scale)

    def backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                 is_causal, rng_state, unused, *, scale=None):
        return ops._flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                                             max_q, max_k, dropout_p, is_causal, rng_state, unused, scale=scale)

    return types.SimpleNamespace(_flash_attention_forward=forward, _flash_attention_backward=backward)


def _torch_flash_ops_with_window():
    """Stands in for ``torch.ops.aten._flash_attention_forward/_backward`` (varlen: lse [H, T])."""

    def _flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                 return_debug_mask, *, scale=None, window_size_left=None,
                                 window_size_right=None, seqused_k=None, alibi_slopes=None):
        _check(dropout_p == 0.0, "the double has no dropout")
        window, right = _flash_edges(window_size_left, window_size_right, is_causal, max_k)
        cq, ck = check_varlen_metadata(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal,
                                       same_head_dim=True, k_bound=True)
        _record("torch_flash", query, key, cq, is_causal, window=window)
        out, lse = varlen_math(query, key, value, cq, ck, query.shape[-1] ** -0.5 if scale is None else scale,
                               is_causal, window, right, empty_lse=float("inf"))
        return out, lse.t().contiguous().float(), _rng_state(query.device), torch.empty(0), torch.empty(0)

    def _flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                                  max_k, dropout_p, is_causal, rng_state, unused, *, scale=None,
                                  window_size_left=None, window_size_right=None):
        _check(logsumexp.shape == (query.shape[1], query.shape[0]), f"lse must be [H, T], got {logsumexp.shape}")
        _check(rng_state.numel() == 2, "rng_state is not the forward's")
        cq, ck = check_varlen_metadata(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal,
                                       same_head_dim=True, k_bound=True)
        return varlen_math_backward(grad_out, query, key, value, out, logsumexp.t().to(query.dtype), cq, ck,
                                    query.shape[-1] ** -0.5 if scale is None else scale, is_causal,
                                    *_flash_edges(window_size_left, window_size_right, is_causal, max_k))

    return types.SimpleNamespace(_flash_attention_forward=_flash_attention_forward,
                                 _flash_attention_backward=_flash_attention_backward)


def fake_flash_attn(version: str = "2.8.3"):
    """(flash_attn, flash_attn.flash_attn_interface) stand-ins with flash-attn 2.7+'s private varlen calls
    (as plain functions; the real ones are custom ops: tests/engine/test_real_libraries.py)."""

    def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                   softmax_scale, causal, window_size_left=-1, window_size_right=-1,
                                   softcap=0.0, alibi_slopes=None, return_softmax=False, block_table=None,
                                   leftpad_k=None, seqused_k=None):
        _check(dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None, "plain attention expected")
        window, right = _flash_edges(window_size_left, window_size_right, causal, max_seqlen_k)
        cq, ck = check_varlen_metadata(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                       same_head_dim=True, k_bound=True)
        _record("flash_attn", q, k, cq, causal, window=window)
        out, lse = varlen_math(q, k, v, cq, ck, softmax_scale, causal, window, right, empty_lse=float("inf"))
        return out, lse.t().contiguous().float(), None, _rng_state(q.device)

    def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                                    window_size_left, window_size_right, softcap, alibi_slopes,
                                    deterministic, rng_state=None, zero_tensors=False):  # 2.7+: no defaults
        _check(softmax_lse.shape == (q.shape[1], q.shape[0]), f"lse must be [H, T], got {softmax_lse.shape}")
        cq, ck = check_varlen_metadata(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                       same_head_dim=True, k_bound=True)
        grads = varlen_math_backward(dout, q, k, v, out, softmax_lse.t().to(q.dtype), cq, ck, softmax_scale,
                                     causal, *_flash_edges(window_size_left, window_size_right, causal,
                                                           max_seqlen_k))
        for dst, src in zip((dq, dk, dv), grads):
            dst.copy_(src)
        return None

    iface = types.SimpleNamespace(_flash_attn_varlen_forward=_flash_attn_varlen_forward,
                                  _flash_attn_varlen_backward=_flash_attn_varlen_backward)
    return types.SimpleNamespace(__version__=version, flash_attn_interface=iface), iface


class FakeFusedAttn(types.SimpleNamespace):
    """Stands in for ``transformer_engine.pytorch.cpp_extensions.fused_attn`` (TE 2.15+ spelling: no
    dqkv_dtype in backward; o_format / do_format / dqkv_layout).

    ``stats_layout``: "thd" gives the softmax stats as [T, H, 1] (newer cuDNN), "padded"
    as [segments, H, max_seqlen_q, 1] (older cuDNN); the engine must take either back.
    """

    def __init__(self, stats_layout: str = "thd"):
        super().__init__(FusedAttnBackend={"F16_arbitrary_seqlen": 1}, stats_layout=stats_layout, calls=[],
                         layouts=[])

    def _common(self, max_q, max_k, cu_q, cu_k, q, k, v, fake_dtype, backend, qkv_layout, attn_mask_type):
        _check(backend == 1, f"fused attention backend {backend!r}, expected F16_arbitrary_seqlen")
        q, k, v = te_layout_reads(q, k, v, qkv_layout)
        _check(attn_mask_type in ("padding", "padding_causal"), f"attn_mask_type {attn_mask_type!r}")
        _check(fake_dtype == q.dtype, "fake_dtype must be q's dtype")
        causal = attn_mask_type == "padding_causal"
        cq, ck = check_varlen_metadata(q, k, v, cu_q, cu_k, max_q, max_k, causal, round_to=64)
        self.layouts.append(qkv_layout)
        return cq, ck, causal, q, k, v

    def _window(self, window_size, bottom_right_diagonal, causal):
        if tuple(window_size) == (-1, -1):
            return None
        _check(bottom_right_diagonal is True, "a window needs bottom_right_diagonal=True (flash's alignment)")
        _check(window_size[1] == (0 if causal else -1), f"window_size {window_size} with causal={causal}")
        return window_size[0]

    def fused_attn_fwd(self, is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v,
                       fake_dtype, fused_attention_backend, attn_bias=None, cu_seqlens_q_padded=None,
                       cu_seqlens_kv_padded=None, page_table_k=None, page_table_v=None, s_quantizer=None,
                       o_quantizer=None, attn_scale=None, dropout=0.0, fast_zero_fill=True,
                       qkv_layout="sbh3d", o_format="sbhd", attn_bias_type="no_bias",
                       attn_mask_type="padding", softmax_type="vanilla", window_size=(-1, -1),
                       bottom_right_diagonal=None, rng_gen=None, softmax_offset=None, return_max_logit=False):
        _check(is_training and dropout == 0.0 and o_format == "thd", "training, no dropout, thd output")
        _check(softmax_type == "vanilla", "sinks are the engine's (once per row), never a kernel's (once per call)")
        cq, ck, causal, q, k, v = self._common(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v,
                                               fake_dtype, fused_attention_backend, qkv_layout, attn_mask_type)
        window = self._window(window_size, bottom_right_diagonal, causal)
        self.calls.append({"mask": attn_mask_type, "max_seqlen_q": max_seqlen_q, "max_seqlen_kv": max_seqlen_kv})
        _record("te", q, k, cq, causal, window=window)
        out, lse = varlen_math(q, k, v, cq, ck, attn_scale, causal, window)
        if self.stats_layout == "thd":
            stats = lse.float().unsqueeze(-1)
        else:
            stats = torch.zeros(len(cq) - 1, q.shape[1], max_seqlen_q, 1)
            for i in range(len(cq) - 1):
                stats[i, :, :cq[i + 1] - cq[i], 0] = lse[cq[i]:cq[i + 1]].t().float()
        return out.reshape(out.shape[0], -1), [stats, _rng_state(q.device)]

    def fused_attn_bwd(self, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o,
                       fake_dtype, aux_ctx_tensors, fused_attention_backend, cu_seqlens_q_padded=None,
                       cu_seqlens_kv_padded=None, s_quantizer=None, dp_quantizer=None, dqkv_quantizer=None,
                       attn_scale=None, dropout=0.0, fast_zero_fill=True, qkv_layout="sbh3d", o_format="sbhd",
                       do_format="sbhd", dqkv_layout="sbh3d", attn_bias_type="no_bias",
                       attn_mask_type="padding", softmax_type="vanilla", window_size=(-1, -1),
                       bottom_right_diagonal=None, deterministic=False):
        _check((o_format, do_format) == ("thd", "thd"), "thd formats expected")
        _check(dqkv_layout == qkv_layout, f"dqkv_layout {dqkv_layout!r} differs from qkv_layout {qkv_layout!r}")
        cq, ck, causal, q, k, v = self._common(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v,
                                               fake_dtype, fused_attention_backend, qkv_layout, attn_mask_type)
        stats = aux_ctx_tensors[0]
        _check(len(aux_ctx_tensors) == 2 and aux_ctx_tensors[1].numel() == 2, "aux must be [stats, rng_state]")
        if self.stats_layout == "thd":
            _check(stats.shape == (q.shape[0], q.shape[1], 1), f"stats must be [T, H, 1], got {stats.shape}")
            lse = stats[..., 0]
        else:
            _check(stats.dim() == 4 and stats.shape[0] == len(cq) - 1, f"padded stats, got {stats.shape}")
            lse = torch.cat([stats[i, :, :cq[i + 1] - cq[i], 0].t() for i in range(len(cq) - 1)])
        o = o.view(q.shape[0], q.shape[1], -1)
        d_o = d_o.view(o.shape)
        dq, dk, dv = varlen_math_backward(d_o, q, k, v, o, lse.to(q.dtype), cq, ck, attn_scale, causal,
                                          self._window(window_size, bottom_right_diagonal, causal))
        return list(te_layout_grads(dq, dk, dv, dqkv_layout)) + [None, None]


FAKE_TE_DTYPE = {torch.float16: "kFloat16", torch.bfloat16: "kBFloat16", torch.float32: "kFloat32",
                 torch.float64: "kFloat64"}  # stands in for TE's constants.TE_DType (fp64: the CPU doubles)


def _te_2_14_spelling(fused: FakeFusedAttn):
    """fused_attn_fwd / fused_attn_bwd as TE 2.8-2.14 spell them: no o_format / do_format / dqkv_layout
    (the layout says thd), and a required tex.DType dqkv_dtype in backward."""
    fwd, bwd = fused.fused_attn_fwd, fused.fused_attn_bwd

    def fused_attn_fwd(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, fake_dtype,
                       fused_attention_backend, attn_bias=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                       page_table_k=None, page_table_v=None, s_quantizer=None, o_quantizer=None, attn_scale=None,
                       dropout=0.0, fast_zero_fill=True, qkv_layout="sbh3d", attn_bias_type="no_bias",
                       attn_mask_type="padding", softmax_type="vanilla", window_size=(-1, -1),
                       bottom_right_diagonal=None, rng_gen=None, softmax_offset=None, return_max_logit=False,
                       cuda_graph=False):
        return fwd(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, fake_dtype,
                   fused_attention_backend, attn_scale=attn_scale, dropout=dropout, qkv_layout=qkv_layout,
                   o_format="thd", attn_mask_type=attn_mask_type, softmax_type=softmax_type,
                   window_size=window_size, bottom_right_diagonal=bottom_right_diagonal)

    def fused_attn_bwd(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o, fake_dtype,
                       dqkv_dtype, aux_ctx_tensors, fused_attention_backend, cu_seqlens_q_padded=None,
                       cu_seqlens_kv_padded=None, s_quantizer=None, dp_quantizer=None, dqkv_quantizer=None,
                       attn_scale=None, dropout=0.0, fast_zero_fill=True, qkv_layout="sbh3d",
                       attn_bias_type="no_bias", attn_mask_type="padding", softmax_type="vanilla",
                       window_size=(-1, -1), bottom_right_diagonal=None, deterministic=False, cuda_graph=False):
        _check(dqkv_dtype == FAKE_TE_DTYPE[q.dtype], f"dqkv_dtype {dqkv_dtype!r}, expected TE_DType[{q.dtype}]")
        return bwd(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o, fake_dtype,
                   aux_ctx_tensors, fused_attention_backend, attn_scale=attn_scale, dropout=dropout,
                   qkv_layout=qkv_layout, o_format="thd", do_format="thd", dqkv_layout=qkv_layout,
                   attn_mask_type=attn_mask_type, softmax_type=softmax_type, window_size=window_size,
                   bottom_right_diagonal=bottom_right_diagonal)

    fused.fused_attn_fwd, fused.fused_attn_bwd = fused_attn_fwd, fused_attn_bwd


def fake_te(version: str = "2.15.0", stats_layout: str = "thd", cudnn: int = 90800):
    """Libraries to override for a stand-in TransformerEngine: {module name: module}.

    ``version`` is what the package reports (for the version gates) and picks the spelling:
    before 2.15, fused_attn as TE 2.14 spells it (``_te_2_14_spelling``), else as 2.15+ does.
    """
    fused = FakeFusedAttn(stats_layout)
    if tuple(int(p) for p in version.split(".")[:2]) < (2, 15):
        _te_2_14_spelling(fused)
    return {
        "transformer_engine": types.SimpleNamespace(__version__=version),
        "transformer_engine.pytorch": types.SimpleNamespace(),
        "transformer_engine.pytorch.cpp_extensions.fused_attn": fused,
        "transformer_engine.pytorch.constants": types.SimpleNamespace(TE_DType=FAKE_TE_DTYPE),
        "transformer_engine_torch": types.SimpleNamespace(get_cudnn_version=lambda: cudnn),
    }
