"""GPT layer specs whose core attention is BlockDiagCPAttention (a one-line change)."""

import copy
import importlib
from typing import Optional

from megatron.core.transformer.spec_utils import ModuleSpec

from .attention import BlockDiagCPAttention


def transformer_engine_available() -> bool:
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception:
        return False
    return True


def nvidia_apex_available() -> bool:
    """NVIDIA apex with its fused norms (the PyPI package named ``apex`` is something else)."""
    try:
        importlib.import_module("apex.normalization.fused_layer_norm")
    except Exception:
        return False
    return True


def with_blockdiag_core_attention(spec: ModuleSpec) -> ModuleSpec:
    """A copy of a GPT layer spec with its core attention replaced by ours."""
    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = BlockDiagCPAttention
    return spec


def _torch_norms(spec: ModuleSpec) -> ModuleSpec:
    # megatron-core picks FusedLayerNorm when *any* module named apex imports; without
    # NVIDIA's fused kernels that module cannot run, so fall back as megatron would.
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    subs = spec.submodules
    for name in ("input_layernorm", "pre_mlp_layernorm", "pre_cross_attn_layernorm"):
        if getattr(subs, name, None) is FusedLayerNorm:
            setattr(subs, name, WrappedTorchNorm)
    attn = subs.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm"):
        if getattr(attn, name, None) is FusedLayerNorm:
            setattr(attn, name, WrappedTorchNorm)
    return spec


def get_gpt_layer_spec_with_blockdiag_cp(
    use_te: Optional[bool] = None,
    num_experts: Optional[int] = None,
    moe_grouped_gemm: bool = False,
    qk_layernorm: bool = False,
    normalization: Optional[str] = None,
) -> ModuleSpec:
    """megatron-core's GPT layer spec (TE when importable, else local) with our core attention.

    ``use_te=None`` picks TransformerEngine's linear/norm modules when TE imports;
    the local spec uses NVIDIA apex's fused norms when apex is present.
    """
    from megatron.core.models.gpt import gpt_layer_specs as specs

    use_te = transformer_engine_available() if use_te is None else use_te
    if use_te:
        spec = specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, qk_layernorm=qk_layernorm)
    else:
        spec = specs.get_gpt_layer_local_spec(
            num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, qk_layernorm=qk_layernorm,
            normalization=normalization)
        if not nvidia_apex_available():
            spec = _torch_norms(spec)
    return with_blockdiag_core_attention(spec)
