"""flash-attn's and TransformerEngine's own Python code on CPU, behind emulated C++ extensions.

``scripts/ci/gpu_libs.sh`` puts each version's Python package in ``.gl/flash-attn-X`` / ``.gl/te-X``.
A worker process loads ONE version (``load_flash_attn`` / ``load_te``): the library's modules are
the shipped files, imported and run as they are; only its compiled extension is replaced:

- ``flash_attn_2_cuda``: ``varlen_fwd`` / ``varlen_bwd`` with that release's C++ argument list
  (count and order) and its return tuple (8 values before 2.7, 4 from 2.7), the C++ checks our
  calls could trip (one head dim for q/k/v, a multiple of 8 and at most 256; int32 cu_seqlens;
  contiguous last dims; Hq % Hkv == 0), flash's bottom-right window rules, the lse as
  ``[H, total_q]`` float32. flash-attn >= 2.7 wraps its varlen calls in
  ``torch.library.custom_op(..., device_types="cuda")``: ``load_flash_attn`` registers the op's
  own Python body as its CPU kernel (``CustomOpDef.register_kernel("cpu", ...)``), so the
  ``CustomOpDef``, its schema and the dispatcher's argument binding stay the library's.
- ``transformer_engine_torch``: the enums and classes TE's Python reads (members made on first
  read, each an int with its name) and ``fused_attn_fwd`` / ``fused_attn_bwd`` taking that
  release's C++ argument list; a ``tex.DType`` where the C++ takes one, a ``torch.dtype`` where it
  takes a ``py::object``. Like the C++, it reads q, k and v from their data pointers with the strides
  the ``qkv_layout`` says (``thd_thd_thd``, or ``thd_th2d``: K and V interleaved per head), not the
  tensors' own, and hands dk / dv back as the halves of one buffer for ``thd_th2d``. TE's package ``__init__`` files load its C++ libraries and import every
  module, so they are not run: ``transformer_engine``, ``.common``, ``.pytorch``,
  ``.pytorch.tensor`` and ``.pytorch.cpp_extensions`` are empty packages over the shipped folders,
  and ``cpp_extensions/fused_attn.py`` with everything it imports (``quantized_tensor``,
  ``constants``, ``common/recipe``, ...) runs as shipped.

What the emulated kernels accept beyond the real ones: fp32 / fp64 inputs (the real kernels take
fp16 / bf16 only; fp64 lets the engine be compared with the fp64 reference) and CPU tensors.
They have no dropout.
"""

import os
import sys
import types

import torch

from megatron_ext.testing.doubles import te_layout_grads, te_layout_reads

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GL = os.path.join(ROOT, ".gl")
FLASH_VERSIONS = ("2.6.3", "2.7.4.post1", "2.8.3")
TE_VERSIONS = ("1.13.0", "2.1.0", "2.8.0", "2.14.0", "2.15.0", "2.20.2")


LIBRARY_MODULES = ("flash_attn", "flash_attn_2_cuda", "transformer_engine", "transformer_engine_torch")


def unload():
    """Drop the loaded library's modules and folders, so another release can be imported.

    flash-attn >= 2.7's custom ops stay registered in the process: load one such release per process.
    """
    for name in [n for n in sys.modules if n.split(".")[0] in LIBRARY_MODULES]:
        del sys.modules[name]
    sys.path[:] = [p for p in sys.path if not p.startswith(GL + os.sep) or p == TE_DEPS]


# pydantic (TE 2.x imports it) has a compiled core: one folder per Python (make test, make test-compat).
TE_DEPS = os.path.join(GL, f"te-deps-py{sys.version_info[0]}{sys.version_info[1]}")


def folder(kind: str, version: str) -> str:
    return os.path.join(GL, f"{kind}-{version}")


def missing_reason(kind: str, version: str):
    """None when the version is installed under .gl/, else why its tests skip."""
    needs = [folder(kind, version)] + ([TE_DEPS] if kind == "te" and version >= "2" else [])
    if all(os.path.isfile(os.path.join(path, ".installed")) for path in needs):
        return None
    failed_file = os.path.join(GL, "FAILED")
    failed = open(failed_file).read().split() if os.path.isfile(failed_file) else []
    package = {"te": "transformer-engine"}.get(kind, kind)
    wanted = [f"{package}=={version}"] + (["pydantic"] if len(needs) > 1 else [])
    ours = [name for name in failed if name in wanted]
    if ours:
        return (f"{kind} {version} is not in .gl/: scripts/ci/gpu_libs.sh could not install {', '.join(ours)} "
                "(registry unreachable?); rerun it")
    return f"{kind} {version} is not in .gl/: run scripts/ci/gpu_libs.sh (.ci/run does, before make test)"


def _vt(version: str):
    return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in version.split(".")[:3])


class EmulationError(RuntimeError):
    """What the real C++ extension would have raised (a TORCH_CHECK, a pybind argument mismatch)."""


def _check(cond, message):
    if not cond:
        raise EmulationError(message)


# ---------------------------------------------------------------------------
# the CPU math: per segment, a masked softmax in float64
# ---------------------------------------------------------------------------


def _hidden(nq, nk, left, right, bottom_right):
    """[nq, nk] keys a query may not see: visible j in [i + off - left, i + off + right] (-1: unbounded)."""
    off = nk - nq if bottom_right else 0
    i, j = torch.arange(nq).unsqueeze(1), torch.arange(nk).unsqueeze(0)
    hidden = torch.zeros(nq, nk, dtype=torch.bool)
    if right >= 0:
        hidden |= j > i + off + right
    if left >= 0:
        hidden |= j < i + off - left
    return hidden


def segments_forward(q, k, v, cq, ck, scale, left, right, bottom_right, empty_lse=float("-inf")):
    """(out [T, Hq, Dv] in q's dtype, lse [T, Hq] float64); a query that sees no key: out 0, lse
    ``empty_lse`` (flash's softmax writes +inf there)."""
    rep = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype)
    lse = torch.full((q.shape[0], q.shape[1]), float("-inf"), dtype=torch.float64)
    for i in range(len(cq) - 1):
        a, b, c, e = cq[i], cq[i + 1], ck[i], ck[i + 1]
        ks = k[c:e].double().repeat_interleave(rep, 1)
        vs = v[c:e].double().repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", q[a:b].double(), ks) * scale
        s = s.masked_fill(_hidden(b - a, e - c, left, right, bottom_right), float("-inf"))
        m = torch.logsumexp(s, -1)  # [H, n]
        p = torch.exp(s - m.unsqueeze(-1)).nan_to_num(0.0)
        out[a:b] = torch.einsum("hqk,khd->qhd", p, vs).to(q.dtype)
        lse[a:b] = m.masked_fill(m == float("-inf"), empty_lse).t()
    return out, lse


def segments_backward(dout, q, k, v, out, lse, cq, ck, scale, left, right, bottom_right):
    """(dq, dk, dv) given the final out and lse [T, Hq] (any float dtype)."""
    rep = q.shape[1] // k.shape[1]
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v))
    delta = (dout.double() * out.double()).sum(-1)  # [T, H]
    for i in range(len(cq) - 1):
        a, b, c, e = cq[i], cq[i + 1], ck[i], ck[i + 1]
        ks = k[c:e].double().repeat_interleave(rep, 1)
        vs = v[c:e].double().repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", q[a:b].double(), ks) * scale
        s = s.masked_fill(_hidden(b - a, e - c, left, right, bottom_right), float("-inf"))
        p = torch.exp(s - lse[a:b].double().t().unsqueeze(-1)).nan_to_num(0.0)
        do = dout[a:b].double()
        dp = torch.einsum("qhd,khd->hqk", do, vs)
        ds = p * (dp - delta[a:b].t().unsqueeze(-1)) * scale
        dq[a:b] = torch.einsum("hqk,khd->qhd", ds, ks)
        dk[c:e] = torch.einsum("hqk,qhd->khd", ds, q[a:b].double()).unflatten(1, (-1, rep)).sum(2)
        dv[c:e] = torch.einsum("hqk,qhd->khd", p, do).unflatten(1, (-1, rep)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _bind(kind, names, args, kwargs):
    _check(not kwargs, f"{kind}: the C++ binding takes positional arguments only, got {sorted(kwargs)}")
    _check(len(args) == len(names), f"{kind}: incompatible function arguments: {len(args)} given, the C++ "
                                    f"signature of this release takes {len(names)} ({', '.join(names)})")
    return dict(zip(names, args))


def _cu(t, name, device):
    _check(isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == 1,
           f"{name} must be a 1-D int32 tensor, got {getattr(t, 'dtype', type(t))}")
    _check(t.device == device, f"{name} on {t.device}, q on {device}")
    return t.tolist()


CALLS = []  # what the emulated kernels were called with in this process (tests read and clear it)
GRAD_LAYOUTS = []  # what the dk / dv each backward call wrote say of their memory (strided_layout)


# ---------------------------------------------------------------------------
# flash_attn_2_cuda
# ---------------------------------------------------------------------------

# csrc/flash_attn/flash_api.cpp, mha_varlen_fwd / mha_varlen_bwd: the same parameter list in 2.6-2.8.
FLASH_FWD_ARGS = ("q", "k", "v", "out_", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "leftpad_k", "block_table",
                  "alibi_slopes", "max_seqlen_q", "max_seqlen_k", "p_dropout", "softmax_scale", "zero_tensors",
                  "is_causal", "window_size_left", "window_size_right", "softcap", "return_softmax", "gen_")
FLASH_BWD_ARGS = ("dout", "q", "k", "v", "out", "softmax_lse", "dq_", "dk_", "dv_", "cu_seqlens_q", "cu_seqlens_k",
                  "alibi_slopes", "max_seqlen_q", "max_seqlen_k", "p_dropout", "softmax_scale", "zero_tensors",
                  "is_causal", "window_size_left", "window_size_right", "softcap", "deterministic", "gen_",
                  "rng_state")


def _flash_common(a, q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check(t.dim() == 3 and t.stride(-1) == 1, f"{name} must be [total, heads, dim] with a contiguous last dim")
    d = q.shape[-1]
    _check(k.shape[-1] == d and v.shape[-1] == d, f"q, k, v must share one head dim: {q.shape} {k.shape} {v.shape}")
    _check(d % 8 == 0, "query, key, value, and out_ must have a head_size that is a multiple of 8")
    _check(d <= 256, "FlashAttention forward only supports head dimension at most 256")
    _check(q.shape[1] % k.shape[1] == 0, "Number of heads in key/value must divide number of heads in query")
    _check(a["alibi_slopes"] is None and a["softcap"] == 0.0 and a["p_dropout"] == 0.0,
           "the emulation has no alibi, softcap or dropout")
    cq, ck = _cu(a["cu_seqlens_q"], "cu_seqlens_q", q.device), _cu(a["cu_seqlens_k"], "cu_seqlens_k", q.device)
    _check(cq[-1] == q.shape[0] and ck[-1] == k.shape[0], "cu_seqlens end past the rows")
    left, right = a["window_size_left"], a["window_size_right"]
    # flash_api.cpp: a window at least max_seqlen_k wide is no window; causal is right = 0.
    if left >= a["max_seqlen_k"]:
        left = -1
    if right >= a["max_seqlen_k"]:
        right = -1
    if a["is_causal"]:
        right = 0
    return cq, ck, *_open_right_edge(left, right, a["max_seqlen_k"])


def _open_right_edge(left, right, max_k):
    """set_params_fprop: a window's open right edge is max_seqlen_k past the bottom-right diagonal."""
    return left, (max_k if left >= 0 and right < 0 else right)


def strided_layout(k, v) -> str:
    """What K and V's strides say of their memory, in TE's layout names (flash reads the strides)."""
    t, h, d = k.shape
    if k.stride() == v.stride() == (2 * h * d, 2 * d, 1) and v.data_ptr() == k.data_ptr() + d * k.element_size():
        return "thd_th2d"
    return "thd_thd_thd" if k.is_contiguous() and v.is_contiguous() else "other"


def flash_cuda_module(version: str):
    """An emulated ``flash_attn_2_cuda`` of flash-attn ``version``."""
    four_results = _vt(version) >= (2, 7)

    def varlen_fwd(*args, **kwargs):
        a = _bind("varlen_fwd", FLASH_FWD_ARGS, args, kwargs)
        q, k, v = a["q"], a["k"], a["v"]
        cq, ck, left, right = _flash_common(a, q, k, v)
        CALLS.append({"kind": "flash_attn", "version": version, "window": (left, right), "causal": a["is_causal"],
                      "hq": q.shape[1], "hkv": k.shape[1], "d": q.shape[-1], "layout": strided_layout(k, v)})
        out, lse = segments_forward(q, k, v, cq, ck, a["softmax_scale"], left, right, True, float("inf"))
        lse = lse.t().contiguous().float()  # [H, total_q]
        rng = torch.zeros(2, dtype=torch.int64)
        p = torch.empty(0, dtype=q.dtype)
        if four_results:
            return [out, lse, p, rng]
        return [out, q, k, v, out, lse, p, rng]  # 2.6: out, q_padded, k_padded, v_padded, out_padded, lse, p, rng

    def varlen_bwd(*args, **kwargs):
        a = _bind("varlen_bwd", FLASH_BWD_ARGS, args, kwargs)
        q, k, v, lse = a["q"], a["k"], a["v"], a["softmax_lse"]
        cq, ck, left, right = _flash_common(a, q, k, v)
        _check(lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32,
               f"softmax_lse must be [H, total_q] float32, got {tuple(lse.shape)} {lse.dtype}")
        _check(a["rng_state"] is None or a["rng_state"].numel() == 2, "rng_state is not a forward's")
        grads = segments_backward(a["dout"], q, k, v, a["out"], lse.t(), cq, ck, a["softmax_scale"], left, right, True)
        if a["dk_"] is not None:
            GRAD_LAYOUTS.append(strided_layout(a["dk_"], a["dv_"]))
        outs = []
        for given, grad in zip((a["dq_"], a["dk_"], a["dv_"]), grads):
            if given is not None:
                _check(given.shape == grad.shape, f"gradient buffer {tuple(given.shape)} != {tuple(grad.shape)}")
                given.copy_(grad)
                grad = given
            outs.append(grad)
        return outs + [torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)]

    return types.SimpleNamespace(__name__="flash_attn_2_cuda", varlen_fwd=varlen_fwd, varlen_bwd=varlen_bwd)


def load_flash_attn(version: str):
    """Import flash-attn ``version``'s shipped Python over the emulated extension; returns its interface."""
    sys.path.insert(0, folder("flash-attn", version))
    sys.modules["flash_attn_2_cuda"] = flash_cuda_module(version)
    import flash_attn
    import flash_attn.flash_attn_interface as iface

    assert flash_attn.__version__ == version, (flash_attn.__version__, version, flash_attn.__file__)
    assert flash_attn.__file__.startswith(folder("flash-attn", version)), flash_attn.__file__
    for name in ("_flash_attn_varlen_forward", "_flash_attn_varlen_backward"):
        op = getattr(iface, name)
        if hasattr(op, "_opoverload"):  # a CustomOpDef registered for CUDA only: its own body as CPU kernel
            op.register_kernel("cpu", op._init_fn)
    return iface


# ---------------------------------------------------------------------------
# transformer_engine_torch
# ---------------------------------------------------------------------------


class EnumMember(int):
    """A pybind enum value: an int with a name (``int(tex.FP8FwdTensors.GEMM1_INPUT)`` works)."""

    def __new__(cls, name: str, value: int):
        self = int.__new__(cls, value)
        self.name = name
        return self

    @property
    def enum(self):
        return type(self).__name__

    def __repr__(self):
        return f"{type(self).__name__}.{self.name}"

    __str__ = __repr__

    def __eq__(self, other):
        if isinstance(other, EnumMember):
            return self is other
        return NotImplemented if not isinstance(other, int) else int(self) == int(other)

    def __ne__(self, other):
        result = self.__eq__(other)
        return result if result is NotImplemented else not result

    def __hash__(self):
        return int.__hash__(self)


class _EnumType(type):
    """A pybind enum class: ``isinstance(x, tex.DType)``, ``tex.DType.__members__``, and (open enums)
    members made on first read, for the many enums TE's Python only names."""

    def __getattr__(cls, member):
        table = cls.__dict__["_table"]
        if member in table:
            return table[member]
        if member.startswith("__") or cls.__dict__["_closed"]:
            raise AttributeError(f"{cls.__name__} has no member {member}")
        return cls._add(member, len(table))

    def _add(cls, member, value):
        if member not in cls._table:
            cls._table[member] = cls(member, value)
        return cls._table[member]

    @property
    def __members__(cls):
        return dict(cls._table)

    def __iter__(cls):
        return iter(cls._table.values())


def make_enum(name: str, members=None):
    """An enum class ``name``: closed with ``members`` ({name: value}), else open."""
    cls = _EnumType(name, (EnumMember,), {"_table": {}, "_closed": False})
    for member, value in (members or {}).items():
        cls._add(member, value)
    cls._closed = members is not None
    return cls


# transformer_engine/common/include/transformer_engine/transformer_engine.h: NVTEDType values.
_TE_DTYPES = {"kByte": 0, "kInt32": 2, "kFloat32": 4, "kFloat16": 5, "kBFloat16": 6, "kFloat8E4M3": 7,
              "kFloat8E5M2": 8, "kFloat4E2M1": 10}


# The C++ argument lists (count and order) of tex.fused_attn_fwd / fused_attn_bwd per release, as
# transformer_engine/pytorch/csrc/extensions.h declares them; the names are the Python wrapper's.
_TE_FWD_HEAD = ("max_seqlen_q", "max_seqlen_kv", "is_training", "attn_scale", "dropout", "fast_zero_fill",
                "qkv_layout")
_TE_BWD_HEAD = ("max_seqlen_q", "max_seqlen_kv", "attn_scale", "dropout", "fast_zero_fill", "qkv_layout")
_TE_FP8_1X_FWD = ("d_scale_qkv", "d_scale_qkv_offset", "d_scale_s", "d_scale_s_offset", "q_scale_s",
                  "q_scale_s_offset", "q_scale_o", "q_scale_o_offset", "amax_s", "amax_s_offset", "amax_o",
                  "amax_o_offset")
_TE_FP8_1X_BWD = ("d_scale_qkv", "d_scale_s", "d_scale_o", "d_scale_do", "d_scale_dp", "q_scale_s", "q_scale_dp",
                  "q_scale_dqkv", "amax_dp", "amax_dqkv")
_QKV = ("cu_seqlens_q", "cu_seqlens_kv", "q", "k", "v")
_PAD = ("cu_seqlens_q_padded", "cu_seqlens_kv_padded")
_Q = ("s_quantizer", "o_quantizer")
_DQ = ("s_quantizer", "dp_quantizer", "dqkv_quantizer")
TE_CPP_ARGS = {
    "1.13": (
        _TE_FWD_HEAD + ("attn_bias_type", "attn_mask_type", "window_size") + _QKV + ("qkv_dtype",) + _PAD
        + _TE_FP8_1X_FWD + ("attn_bias", "rng_gen", "rng_elts_per_thread"),
        _TE_BWD_HEAD + ("attn_bias_type", "attn_mask_type", "window_size", "deterministic") + _QKV
        + ("o", "d_o", "qkv_dtype", "dqkv_dtype", "aux_ctx_tensors") + _PAD + _TE_FP8_1X_BWD),
    "2.1": (
        _TE_FWD_HEAD + ("attn_bias_type", "attn_mask_type", "window_size") + _QKV + ("fake_dtype",) + _PAD + _Q
        + ("attn_bias", "rng_gen", "rng_elts_per_thread"),
        _TE_BWD_HEAD + ("attn_bias_type", "attn_mask_type", "window_size", "deterministic") + _QKV
        + ("o", "d_o", "fake_dtype", "dqkv_dtype", "aux_ctx_tensors") + _PAD + _DQ),
    "2.8": (
        _TE_FWD_HEAD + ("attn_bias_type", "attn_mask_type", "softmax_type", "window_size") + _QKV + ("fake_dtype",)
        + _PAD + ("page_table_k", "page_table_v") + _Q + ("attn_bias", "softmax_offset", "rng_gen",
                                                          "rng_elts_per_thread"),
        _TE_BWD_HEAD + ("attn_bias_type", "attn_mask_type", "softmax_type", "window_size", "deterministic") + _QKV
        + ("o", "d_o", "fake_dtype", "dqkv_dtype", "aux_ctx_tensors") + _PAD + _DQ),
    "2.14": (
        _TE_FWD_HEAD + ("attn_bias_type", "attn_mask_type", "softmax_type", "window_size", "bottom_right_diagonal")
        + _QKV + ("fake_dtype",) + _PAD + ("page_table_k", "page_table_v") + _Q
        + ("attn_bias", "softmax_offset", "rng_gen", "rng_elts_per_thread", "return_max_logit", "cuda_graph"),
        _TE_BWD_HEAD + ("attn_bias_type", "attn_mask_type", "softmax_type", "window_size", "bottom_right_diagonal",
                        "deterministic") + _QKV
        + ("o", "d_o", "fake_dtype", "dqkv_dtype", "aux_ctx_tensors") + _PAD + _DQ + ("cuda_graph",)),
    "2.15": (
        _TE_FWD_HEAD + ("o_format", "qkv_scale_inv_format", "attn_bias_type", "attn_mask_type", "softmax_type",
                        "window_size", "bottom_right_diagonal") + _QKV + ("fake_dtype",) + _PAD
        + ("page_table_k", "page_table_v") + _Q
        + ("attn_bias", "softmax_offset", "rng_gen", "rng_elts_per_thread", "return_max_logit", "cuda_graph"),
        _TE_BWD_HEAD + ("o_format", "do_format", "dqkv_layout", "qkv_scale_inv_format", "do_scale_inv_format",
                        "attn_bias_type", "attn_mask_type", "softmax_type", "window_size", "bottom_right_diagonal",
                        "deterministic") + _QKV
        + ("o", "d_o", "fake_dtype", "aux_ctx_tensors") + _PAD + _DQ + ("cuda_graph",)),
}
TE_CPP_ARGS["2.20"] = TE_CPP_ARGS["2.15"]


# The layouts the engine passes, as the C++ enum's members print, and what they say of memory.
_TE_LAYOUTS = {"NVTE_QKV_Layout.NVTE_THD_THD_THD": "thd_thd_thd", "NVTE_QKV_Layout.NVTE_THD_TH2D": "thd_th2d"}


def _te_args_key(version: str) -> str:
    """The TE_CPP_ARGS entry of ``version``: the release that last changed the C++ argument lists."""
    v = _vt(version)
    return "1.13" if v < (2, 0) else "2.1" if v < (2, 8) else "2.8" if v < (2, 14) else "2.14" if v < (2, 15) \
        else "2.15" if v < (2, 20) else "2.20"


def te_torch_module(version: str, stats_layout: str = "thd"):
    """An emulated ``transformer_engine_torch`` of TE ``version``.

    ``stats_layout``: the softmax stats cuDNN gives for THD: "thd" [tq, h, 1] (cuDNN > 9.6) or
    "padded" [b, h, max_seqlen_q, 1] (older cuDNN).
    """
    fwd_names, bwd_names = TE_CPP_ARGS[_te_args_key(version)]
    mod = types.ModuleType("transformer_engine_torch")
    mod.DType = make_enum("DType", _TE_DTYPES)
    backends = {"NVTE_No_Backend": -1, "NVTE_F16_max512_seqlen": 0, "NVTE_F16_arbitrary_seqlen": 1, "NVTE_FP8": 2}
    if _vt(version) >= (2, 20):  # the max512 backend is gone from the C++ enum
        del backends["NVTE_F16_max512_seqlen"]
    mod.NVTE_Fused_Attn_Backend = make_enum("NVTE_Fused_Attn_Backend", backends)

    def module_getattr(name):
        if name.startswith("__"):
            raise AttributeError(name)
        setattr(mod, name, make_enum(name))
        return getattr(mod, name)

    mod.__getattr__ = module_getattr
    mod.get_cudnn_version = lambda: 90800

    def dtype_arg(a, name):
        value = a[name]
        if name == "fake_dtype":  # py::object: a torch.dtype
            _check(isinstance(value, torch.dtype), f"fake_dtype must be a torch.dtype, got {value!r}")
            _check(value == a["q"].dtype, f"fake_dtype {value} is not q's dtype {a['q'].dtype}")
        else:  # transformer_engine::DType
            _check(isinstance(value, mod.DType),
                   f"incompatible function arguments: {name} must be transformer_engine_torch.DType, got {value!r}")

    def mask(a):
        mask_name = a["attn_mask_type"].name
        _check(mask_name in ("NVTE_PADDING_MASK", "NVTE_PADDING_CAUSAL_MASK",
                             "NVTE_PADDING_CAUSAL_BOTTOM_RIGHT_MASK"), f"mask {mask_name}")
        _check(a["attn_bias_type"].name == "NVTE_NO_BIAS", "no bias")
        _check("softmax_type" not in a or a["softmax_type"].name == "NVTE_VANILLA_SOFTMAX", "vanilla softmax only")
        causal = "CAUSAL" in mask_name
        bottom_right = a.get("bottom_right_diagonal")
        if bottom_right is None:
            bottom_right = "BOTTOM_RIGHT" in mask_name
        left, right = tuple(a["window_size"])
        if causal:
            right = 0
        return causal, left, right, bottom_right

    def layout(a, name="qkv_layout"):
        value = a[name]
        _check(repr(value) in _TE_LAYOUTS, f"the emulation takes {sorted(_TE_LAYOUTS.values())}, got {value!r}")
        return _TE_LAYOUTS[repr(value)]

    def fused_attn_fwd(*args, **kwargs):
        a = _bind("fused_attn_fwd", fwd_names, args, kwargs)
        q, k, v = te_layout_reads(a["q"], a["k"], a["v"], layout(a))
        dtype_arg(a, "fake_dtype" if "fake_dtype" in a else "qkv_dtype")
        _check(a["dropout"] == 0.0 and a["is_training"], "training without dropout")
        if "o_format" in a:
            _check(a["o_format"].name == "NVTE_THD", f"o_format {a['o_format']!r}")
        causal, left, right, bottom_right = mask(a)
        cq, ck = _cu(a["cu_seqlens_q"], "cu_seqlens_q", q.device), _cu(a["cu_seqlens_kv"], "cu_seqlens_kv", q.device)
        _check(cq[-1] == q.shape[0] and ck[-1] == k.shape[0], "cu_seqlens end past the rows")
        _check(q.shape[-1] == k.shape[-1] and q.shape[1] % k.shape[1] == 0, "head dims / heads")
        CALLS.append({"kind": "te", "version": version, "window": (left, right), "causal": causal,
                      "bottom_right": bottom_right, "hq": q.shape[1], "hkv": k.shape[1], "layout": layout(a)})
        out, lse = segments_forward(q, k, v, cq, ck, a["attn_scale"], left, right, bottom_right)
        if stats_layout == "thd":
            stats = lse.float().unsqueeze(-1)  # [tq, h, 1]
        else:
            stats = torch.zeros(len(cq) - 1, q.shape[1], a["max_seqlen_q"], 1)
            for i in range(len(cq) - 1):
                stats[i, :, :cq[i + 1] - cq[i], 0] = lse[cq[i]:cq[i + 1]].t().float()
        return [out, stats, torch.zeros(2, dtype=torch.int64)]

    def fused_attn_bwd(*args, **kwargs):
        a = _bind("fused_attn_bwd", bwd_names, args, kwargs)
        q, k, v = te_layout_reads(a["q"], a["k"], a["v"], layout(a))
        grad_layout = layout(a, "dqkv_layout") if "dqkv_layout" in a else layout(a)  # before 2.15: qkv_layout's
        dtype_arg(a, "fake_dtype" if "fake_dtype" in a else "qkv_dtype")
        if "dqkv_dtype" in a:
            dtype_arg(a, "dqkv_dtype")
        if "dqkv_layout" in a:
            _check(a["o_format"].name == "NVTE_THD" and a["do_format"].name == "NVTE_THD", "o/do formats")
        causal, left, right, bottom_right = mask(a)
        cq, ck = _cu(a["cu_seqlens_q"], "cu_seqlens_q", q.device), _cu(a["cu_seqlens_kv"], "cu_seqlens_kv", q.device)
        aux = a["aux_ctx_tensors"]
        _check(len(aux) == 2 and aux[1].numel() == 2, "aux_ctx_tensors must be [stats, rng_state]")
        stats = aux[0]
        if stats.dim() == 3:
            _check(stats.shape == (q.shape[0], q.shape[1], 1), f"stats {tuple(stats.shape)}")
            lse = stats[..., 0]
        else:
            lse = torch.cat([stats[i, :, :cq[i + 1] - cq[i], 0].t() for i in range(len(cq) - 1)])
        o = a["o"].view(q.shape[0], q.shape[1], -1)
        d_o = a["d_o"].view(o.shape)
        grads = segments_backward(d_o, q, k, v, o, lse, cq, ck, a["attn_scale"], left, right, bottom_right)
        grads = te_layout_grads(*grads, grad_layout)
        GRAD_LAYOUTS.append(strided_layout(grads[1], grads[2]))
        return list(grads) + [None, None]

    mod.fused_attn_fwd, mod.fused_attn_bwd = fused_attn_fwd, fused_attn_bwd
    return mod


_TE_PACKAGES = ("transformer_engine", "transformer_engine.common", "transformer_engine.pytorch",
                "transformer_engine.pytorch.tensor", "transformer_engine.pytorch.cpp_extensions")


def load_te(version: str, stats_layout: str = "thd"):
    """Import TE ``version``'s shipped fused_attn.py over the emulated extension; returns the module."""
    import importlib.metadata

    base = folder("te", version)
    if TE_DEPS not in sys.path:  # appended, so the venv's own packages come first
        sys.path.append(TE_DEPS)
    sys.modules["transformer_engine_torch"] = te_torch_module(version, stats_layout)
    for name in _TE_PACKAGES:  # empty packages over the shipped folders: their __init__ loads C++ libraries
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(base, *name.split("."))]
        package.__package__ = name
        sys.modules[name] = package
    dist = importlib.metadata.PathDistribution.at(os.path.join(base, f"transformer_engine-{version}.dist-info"))
    sys.modules["transformer_engine"].__version__ = dist.version
    import transformer_engine.pytorch.cpp_extensions.fused_attn as fused_attn

    assert fused_attn.__file__.startswith(base), fused_attn.__file__
    return fused_attn


# ---------------------------------------------------------------------------
# torch's own flash ops: CPU kernels under the schemas this torch registers
# ---------------------------------------------------------------------------


def _schema_bind(op, args, kwargs):
    names = [a.name for a in op.default._schema.arguments]
    bound = dict(zip(names, args))
    _check(not set(kwargs) & set(bound), f"arguments given twice: {set(kwargs) & set(bound)}")
    bound.update(kwargs)
    return bound


def register_aten_flash_cpu():
    """CPU kernels for ``aten::_flash_attention_forward/backward``; keep the returned Library alive.

    The dispatcher binds the caller's arguments by the real schema before these run; they apply
    the checks of torch's flash C++ (aten/src/ATen/native/transformers/cuda/flash_attn) our calls
    could trip, and flash's bottom-right window rules.
    """
    aten = torch.ops.aten
    lib = torch.library.Library("aten", "IMPL")

    def window(a, max_k, causal):
        left = -1 if a.get("window_size_left") is None else a["window_size_left"]
        right = -1 if a.get("window_size_right") is None else a["window_size_right"]
        left = -1 if left >= max_k else left
        right = 0 if causal else (-1 if right >= max_k else right)
        return _open_right_edge(left, right, max_k)

    def common(a, q, k, v):
        d = q.shape[-1]
        _check(k.shape[-1] == d and v.shape[-1] == d, f"q, k, v must share one head dim: {q.shape} {v.shape}")
        _check(d % 8 == 0 and d <= 256, f"head dim {d}: flash takes a multiple of 8, at most 256")
        _check(q.shape[1] % k.shape[1] == 0, "Number of heads in key/value must divide number of heads in query")
        _check(a["dropout_p"] == 0.0, "the emulation has no dropout")
        _check(all(t.stride(-1) == 1 for t in (q, k, v)), "Input tensor must have contiguous last dimension")
        cq, ck = _cu(a["cum_seq_q"], "cum_seq_q", q.device), _cu(a["cum_seq_k"], "cum_seq_k", q.device)
        scale = a.get("scale")
        return cq, ck, d ** -0.5 if scale is None else scale, window(a, a["max_k"], a["is_causal"])

    def forward(*args, **kwargs):
        a = _schema_bind(aten._flash_attention_forward, args, kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        cq, ck, scale, (left, right) = common(a, q, k, v)
        CALLS.append({"kind": "torch_flash", "window": (left, right), "causal": a["is_causal"],
                      "layout": strided_layout(a["key"], a["value"])})
        out, lse = segments_forward(q, k, v, cq, ck, scale, left, right, True, float("inf"))
        seed = torch.zeros((), dtype=torch.int64)
        return out, lse.t().contiguous().float(), seed, seed.clone(), torch.empty(0, dtype=q.dtype)

    def backward(*args, **kwargs):
        a = _schema_bind(aten._flash_attention_backward, args, kwargs)
        q, k, v, lse = a["query"], a["key"], a["value"], a["logsumexp"]
        cq, ck, scale, (left, right) = common(a, q, k, v)
        _check(lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32,
               f"logsumexp must be [H, total_q] float32, got {tuple(lse.shape)} {lse.dtype}")
        return segments_backward(a["grad_out"], q, k, v, a["out"], lse.t(), cq, ck, scale, left, right, True)

    lib.impl("_flash_attention_forward", forward, "CPU")
    lib.impl("_flash_attention_backward", backward, "CPU")
    return lib
