"""Test doubles for the flash and TE varlen kernels: plain-torch math behind their call contracts.

What these doubles test: OUR side of the contract -- the metadata the engine
hands a varlen kernel (cu_seqlens, max_seqlen, dtypes, devices, strides, head
counts, the bottom-right causal flag, the TE keyword arguments, TE module
caching) and the plumbing around the call (packing, GQA head order, the exchange
feeding the keys). They run on CPU in fp32/fp64.

What they do NOT test: the real CUDA kernels (flash-attn, torch's varlen_attn,
TransformerEngine's fused attention), their numerics in bf16, or whether a given
GPU/driver/library version accepts the call. The GPU check
(``scripts/gpu_check.sh``) does that on a GPU machine.

Every double computes, for each segment i, softmax(q_i k_i^T * scale) v_i over
q[cu_q[i]:cu_q[i+1]] and k/v[cu_k[i]:cu_k[i+1]] with a bottom-right causal mask
(query j of n_q sees keys 0 .. n_k - n_q + j), GQA by repeat_interleave of the
K/V heads -- explicit math, sharing no code with megatron_ext's dense kernel.
"""

import types
from typing import List, Optional

import torch


class ContractError(AssertionError):
    """The engine called a kernel double with metadata a real kernel would reject or misread."""


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ContractError(message)


def check_varlen_metadata(q, k, v, cu_q, cu_k, max_q, max_k) -> tuple:
    """Validate what a real varlen kernel relies on; return host copies of cu_seqlens."""
    _check(q.dim() == 3 and k.dim() == 3 and v.dim() == 3, f"q/k/v must be [T, H, D]: {q.shape} {k.shape}")
    _check(k.shape == v.shape, f"k {tuple(k.shape)} != v {tuple(v.shape)}")
    _check(q.shape[2] == k.shape[2], "head dims differ")
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
    _check(min(nq) >= 0 and min(nk) >= 0, "cu_seqlens must be non-decreasing")
    _check(all(b >= a for a, b in zip(nq, nk)),
           "a segment has fewer keys than queries (its keys must include its own queries)")
    _check(int(max_q) == max(nq), f"max_seqlen_q={max_q} but the longest query segment is {max(nq)}")
    _check(int(max_k) == max(nk), f"max_seqlen_k={max_k} but the longest key segment is {max(nk)}")
    return cq, ck


def varlen_math(q, k, v, cq: List[int], ck: List[int], scale: float):
    """Per-segment bottom-right causal softmax attention, explicit (einsum + masked softmax)."""
    rep = q.shape[1] // k.shape[1]
    outs = []
    for i in range(len(cq) - 1):
        qs = q[cq[i]:cq[i + 1]]
        ks = k[ck[i]:ck[i + 1]].repeat_interleave(rep, dim=1)
        vs = v[ck[i]:ck[i + 1]].repeat_interleave(rep, dim=1)
        n_q, n_k = qs.shape[0], ks.shape[0]
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        visible = torch.arange(n_k).unsqueeze(0) <= torch.arange(n_q).unsqueeze(1) + (n_k - n_q)
        scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, vs))
    return torch.cat(outs, dim=0)


# ---------------------------------------------------------------------------
# engine-level double: stands in for the flash kernel (override_kernel("flash", ...))
# ---------------------------------------------------------------------------

CALLS: List[dict] = []  # metadata of every double call in this process (tests read and clear it)


def flash_kernel_double(q, k, v, seg, softmax_scale, dropout_p=0.0):
    """Drop-in for the engine's flash kernel (the kernel contract of kernels.py)."""
    _check(dropout_p == 0.0, "the double has no dropout")
    cq, ck = check_varlen_metadata(q, k, v, seg.cu_seqlens_q, seg.cu_seqlens_k,
                                   seg.max_seqlen_q, seg.max_seqlen_k)
    _check(list(seg.q_lens) == [b - a for a, b in zip(cq[:-1], cq[1:])], "host q_lens disagree with cu_seqlens_q")
    _check(list(seg.k_lens) == [b - a for a, b in zip(ck[:-1], ck[1:])], "host k_lens disagree with cu_seqlens_k")
    CALLS.append({"kind": "kernel", "segments": len(cq) - 1, "hq": q.shape[1], "hkv": k.shape[1]})
    return varlen_math(q, k, v, cq, ck, softmax_scale)


# ---------------------------------------------------------------------------
# library-level doubles: what kernels.flash_varlen calls
# ---------------------------------------------------------------------------


def fake_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                softcap=0.0, alibi_slopes=None, deterministic=False,
                                return_attn_probs=False, block_table=None):
    """flash-attn 2.x ``flash_attn_varlen_func`` signature; causal is bottom-right (>= 2.1)."""
    _check(causal is True, "flash_attn_varlen_func must be called with causal=True")
    _check(tuple(window_size) == (-1, -1), "no sliding window expected")
    _check(dropout_p == 0.0, "the double has no dropout")
    cq, ck = check_varlen_metadata(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    CALLS.append({"kind": "flash_attn", "segments": len(cq) - 1, "hq": q.shape[1], "hkv": k.shape[1]})
    return varlen_math(q, k, v, cq, ck, scale)


def _torch_varlen_common(api, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, gqa_ok):
    _check(causal, f"torch varlen_attn ({api}) must be called causal")
    if not gqa_ok:
        _check(q.shape[1] == k.shape[1], f"torch varlen_attn ({api}) has no GQA: K/V heads must be repeated")
    cq, ck = check_varlen_metadata(q, k, v, cu_q, cu_k, max_q, max_k)
    CALLS.append({"kind": f"torch_varlen_{api}", "segments": len(cq) - 1, "hq": q.shape[1],
                  "hkv": k.shape[1]})
    return varlen_math(q, k, v, cq, ck, q.shape[-1] ** -0.5 if scale is None else scale)


def fake_varlen_attn_is_causal(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                                return_aux=None):
    """The first public spelling (older torch docs): ``is_causal``, no ``scale``, no GQA."""
    return _torch_varlen_common("is_causal", query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                                is_causal, None, gqa_ok=False)


def fake_varlen_attn_window(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                            scale=None, window_size=(-1, -1)):
    """Later spelling: keyword-only ``scale`` and ``window_size`` ((-1, 0) = causal), no GQA."""
    return _torch_varlen_common("window", query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                                tuple(window_size) == (-1, 0), scale, gqa_ok=False)


def fake_varlen_attn_window_gqa(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *,
                                return_aux=None, scale=None, window_size=(-1, -1), enable_gqa=False,
                                seqused_k=None, block_table=None, num_splits=None):
    """torch 2.12/2.13 spelling: adds ``enable_gqa``."""
    return _torch_varlen_common("window_gqa", query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                                tuple(window_size) == (-1, 0), scale, gqa_ok=enable_gqa)


TORCH_VARLEN_FAKES = {"is_causal": fake_varlen_attn_is_causal, "window": fake_varlen_attn_window,
                      "window_gqa": fake_varlen_attn_window_gqa}


# ---------------------------------------------------------------------------
# TE double: a stand-in ``transformer_engine.pytorch`` module
# ---------------------------------------------------------------------------


class FakeDotProductAttention(torch.nn.Module):
    """Mimics TE's ``DotProductAttention`` constructor and forward keywords (thd format).

    Records every construction (``CONSTRUCTED``) and call (``FORWARDS``); the
    signatures spell TE's parameter names, so a misspelt keyword fails here as it
    would in TE. Output is [t, h * d], as TE returns for thd.
    """

    CONSTRUCTED: List[dict] = []
    FORWARDS: List[dict] = []

    def __init__(self, num_attention_heads: int, kv_channels, num_gqa_groups: Optional[int] = None,
                 attention_dropout: float = 0.0, qkv_format: str = "sbhd", attn_mask_type: str = "causal",
                 window_size=None, sequence_parallel: bool = False, tp_size: int = 1,
                 get_rng_state_tracker=None, tp_group=None, layer_number=None, attention_type: str = "self",
                 cp_group=None, cp_global_ranks=None, cp_stream=None, cp_comm_type: str = "p2p",
                 softmax_scale: Optional[float] = None):
        super().__init__()
        self.config = dict(num_attention_heads=num_attention_heads, kv_channels=kv_channels,
                           num_gqa_groups=num_gqa_groups, attention_dropout=attention_dropout,
                           qkv_format=qkv_format, attn_mask_type=attn_mask_type,
                           softmax_scale=softmax_scale, cp_group=cp_group)
        FakeDotProductAttention.CONSTRUCTED.append(dict(self.config))

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None, qkv_format=None,
                cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                max_seqlen_q=None, max_seqlen_kv=None, attn_mask_type=None, window_size=None,
                checkpoint_core_attention=False, core_attention_bias_type="no_bias",
                core_attention_bias=None, alibi_slopes=None, fast_zero_fill=True, inference_params=None):
        cfg = self.config
        _check(qkv_format == "thd" and cfg["qkv_format"] == "thd", f"qkv_format {qkv_format!r}")
        _check(attn_mask_type == "padding_causal_bottom_right" == cfg["attn_mask_type"],
               f"attn_mask_type {attn_mask_type!r} / {cfg['attn_mask_type']!r}")
        _check(cfg["cp_group"] is None, "TE must not run its own CP: the engine already exchanged K/V")
        _check(attention_mask is None and window_size is None, "no mask tensor / window expected")
        _check(query_layer.shape[1] == cfg["num_attention_heads"], "query heads != num_attention_heads")
        _check(key_layer.shape[1] == cfg["num_gqa_groups"], "K/V heads != num_gqa_groups")
        _check(query_layer.shape[2] == cfg["kv_channels"], "head dim != kv_channels")
        _check(cfg["attention_dropout"] == 0.0, "the double has no dropout")
        cq, ck = check_varlen_metadata(query_layer, key_layer, value_layer, cu_seqlens_q, cu_seqlens_kv,
                                       max_seqlen_q, max_seqlen_kv)
        FakeDotProductAttention.FORWARDS.append({"segments": len(cq) - 1, "max_seqlen_q": max_seqlen_q,
                                                 "max_seqlen_kv": max_seqlen_kv})
        scale = cfg["softmax_scale"]
        scale = query_layer.shape[-1] ** -0.5 if scale is None else scale
        out = varlen_math(query_layer, key_layer, value_layer, cq, ck, scale)
        return out.reshape(out.shape[0], -1)  # [t, h * d]


def fake_te_pytorch() -> types.ModuleType:
    """A stand-in ``transformer_engine.pytorch`` with the fake ``DotProductAttention``.

    Hand it to ``override_library("transformer_engine.pytorch", ...)``; its call logs start empty.
    """
    module = types.ModuleType("transformer_engine.pytorch")
    module.DotProductAttention = FakeDotProductAttention
    FakeDotProductAttention.CONSTRUCTED.clear()
    FakeDotProductAttention.FORWARDS.clear()
    return module


def library_with(attribute: str, fn) -> types.SimpleNamespace:
    """A stand-in library module exposing one function, e.g. ``flash_attn.flash_attn_varlen_func``."""
    return types.SimpleNamespace(**{attribute: fn})
