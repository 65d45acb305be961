"""GPT layer specs whose core attention is BlockDiagCPAttention (a one-line change).

Two ways in:

- ``get_gpt_layer_spec_with_blockdiag_cp(...)`` / ``with_blockdiag_core_attention(spec)``: a
  spec you build in Python, with the options you pass;
- ``blockdiag_cp_gpt_layer_spec`` (``--spec megatron_ext.layers blockdiag_cp_gpt_layer_spec``):
  one ``ModuleSpec`` that honours the model config on both of Megatron-LM's builder routes. Its
  module, ``BlockDiagCPTransformerLayer``, builds each layer from the layer spec megatron-core's
  own GPT builders give that layer for the config it is built with (``--qk-layernorm``,
  ``--num-experts`` with ``--moe-layer-freq``, ``--multi-latent-attention``, ``--normalization``,
  ``--qk-l2-norm``, ...), with our core attention; what it cannot honour is refused at model
  build, naming the flag (``LAYOUTS_REFUSED``).
"""

import copy
import functools
import importlib
import logging
from typing import Optional

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from ..blockdiag_cp import BlockDiagCPError
from ..megatron_lm import config_field, megatron_lm_flag
from .attention import BlockDiagCPAttention

logger = logging.getLogger(__name__)


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


def torch_norms(spec: ModuleSpec) -> ModuleSpec:
    # megatron-core picks FusedLayerNorm when *any* module named apex imports; without
    # NVIDIA's fused kernels that module cannot run, so fall back as megatron would.
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    subs = spec.submodules
    for name in ("input_layernorm", "pre_mlp_layernorm", "pre_cross_attn_layernorm"):
        if getattr(subs, name, None) is FusedLayerNorm:
            setattr(subs, name, WrappedTorchNorm)
    attn = subs.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm", "kv_layernorm"):  # kv_layernorm: MLA
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
            spec = torch_norms(spec)
    return with_blockdiag_core_attention(spec)


# ---------------------------------------------------------------------------
# The config-honouring spec (Megatron-LM's --spec)
# ---------------------------------------------------------------------------

# Config values the spec cannot build a faithful layer for: (field, is-set test, why). The error
# names the field and its Megatron-LM flag (megatron_lm.MEGATRON_LM_FLAGS).
LAYOUTS_REFUSED = (
    ("experimental_attention_variant", lambda v: v is not None,
     "its attention (gated delta net, DSA) is not per-document softmax attention"),
    ("heterogeneous_block_specs", bool, "per-layer heterogeneous blocks are not built by this spec yet"),
    ("mtp_num_layers", lambda v: bool(v),
     "multi-token prediction layers are not supported with BlockDiagCPAttention yet"),
    ("transformer_impl", lambda v: v == "inference_optimized",
     "the inference-optimized layers are not built by this spec"),
    ("use_kitchen_attention", bool,
     "it asks for kitchen's core attention, which this spec would replace with ours"),
)


@functools.lru_cache(maxsize=None)
def _warn_no_te_once() -> None:
    logger.warning("megatron_ext: transformer_impl=transformer_engine but TransformerEngine does not "
                   "import; building megatron-core's local layer spec with BlockDiagCPAttention")


def _use_te(config) -> bool:
    impl = getattr(config, "transformer_impl", None)
    if impl == "local":
        return False
    if transformer_engine_available():
        return True
    if impl == "transformer_engine":
        _warn_no_te_once()
    return False


def _call_with_config(fn, config, **options):
    """``fn(**options)`` with the options the installed megatron-core's ``fn`` takes.

    An option it does not take is dropped when the config leaves it at its off value and
    refused (naming the field) when the config sets it: that version cannot build it.
    """
    import inspect

    params = inspect.signature(fn).parameters
    kwargs = {}
    for name, value in options.items():
        if name in params:
            kwargs[name] = value
        elif value not in (None, False, "sdpa"):
            raise BlockDiagCPError(
                f"{config_field(name, value)} needs a newer megatron-core than the installed one "
                f"({fn.__module__}.{fn.__name__} has no {name!r})")
    return fn(**kwargs)


def megatron_layer_spec_for(config, layer_number: int) -> ModuleSpec:
    """The spec megatron-core's GPT builders give layer ``layer_number`` (global, 1-based), ours inside.

    Mirrors Megatron-LM's ``gpt_builder``: MoE configs take the layer out of
    ``get_gpt_decoder_layer_specs`` (dense and expert layers by ``moe_layer_freq``), others
    the TE or local layer spec with the config's options.
    """
    from megatron.core.models.gpt import gpt_layer_specs as specs

    for field, is_set, why in LAYOUTS_REFUSED:
        value = getattr(config, field, None)
        if is_set(value):
            raise BlockDiagCPError(
                f"{config_field(field, value)} is not built by blockdiag_cp_gpt_layer_spec: {why}; drop "
                f"{megatron_lm_flag(field)}, or use megatron-core's own layer spec (drop --spec) for this "
                "model")
    use_te = _use_te(config)
    if getattr(config, "num_moe_experts", None):
        layer_specs = specs.get_gpt_decoder_layer_specs(
            config, use_transformer_engine=use_te, normalization=getattr(config, "normalization", None),
            qk_l2_norm=getattr(config, "qk_l2_norm", False))
        spec = layer_specs[layer_number - 1]
    else:
        common = dict(num_experts=None, moe_grouped_gemm=getattr(config, "moe_grouped_gemm", False),
                      qk_layernorm=config.qk_layernorm,
                      multi_latent_attention=getattr(config, "multi_latent_attention", False),
                      qk_l2_norm=getattr(config, "qk_l2_norm", False),
                      use_kitchen=getattr(config, "use_kitchen", False))
        if use_te:
            spec = _call_with_config(
                specs.get_gpt_layer_with_transformer_engine_spec, config, **common,
                use_te_activation_func=getattr(config, "use_te_activation_func", False),
                mla_down_proj_fusion=getattr(config, "mla_down_proj_fusion", False),
                use_grouped_gemm_for_dense_mlp=getattr(config, "use_grouped_gemm_for_dense_mlp", False))
        else:
            spec = _call_with_config(specs.get_gpt_layer_local_spec, config, **common,
                                     normalization=getattr(config, "normalization", None))
    spec = with_blockdiag_core_attention(spec)
    if not use_te and not nvidia_apex_available():
        spec = torch_norms(spec)
    return spec


def _global_layer_number(config, layer_number: int, kwargs) -> int:
    """The layer's global number, as megatron's TransformerLayer computes it."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if kwargs.get("is_mtp_layer", False) or not kwargs.get("add_layer_offset", True):
        return layer_number
    pg_collection = kwargs.get("pg_collection")
    pp_group = getattr(pg_collection, "pp", None) if pg_collection is not None else None
    if pp_group is not None:
        import torch.distributed as dist

        pp_rank = dist.get_rank(pp_group)
    else:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank() \
            if parallel_state.model_parallel_is_initialized() else 0
    return layer_number + get_transformer_layer_offset(config, kwargs.get("vp_stage"), pp_rank)


class BlockDiagCPTransformerLayer(TransformerLayer):
    """megatron-core's TransformerLayer, built from megatron's own layer spec for this config.

    ``blockdiag_cp_gpt_layer_spec``'s module: the ``submodules`` handed in are the spec's
    default (dense) template, and are replaced by ``megatron_layer_spec_for(config, layer)``.
    Parameter names and state dicts are those of megatron's own layer for the same config.
    """

    def __init__(self, config, submodules=None, layer_number: int = 1, **kwargs):
        attention = getattr(getattr(getattr(submodules, "self_attention", None), "submodules", None),
                            "core_attention", BlockDiagCPAttention)
        if attention is not BlockDiagCPAttention:
            name = getattr(attention, "__name__", repr(attention))
            raise BlockDiagCPError(
                f"blockdiag_cp_gpt_layer_spec's core attention was replaced by {name} (e.g. by "
                "--attention-backend local); this spec always builds BlockDiagCPAttention: drop "
                "the replacement, or use megatron's own spec")
        spec = megatron_layer_spec_for(config, _global_layer_number(config, layer_number, kwargs))
        if spec.module is not TransformerLayer:
            raise BlockDiagCPError(
                f"megatron-core builds {getattr(spec.module, '__name__', spec.module)} for this config, not "
                "a TransformerLayer; blockdiag_cp_gpt_layer_spec cannot build it")
        super().__init__(config=config, submodules=spec.submodules, layer_number=layer_number,
                         **{**spec.params, **kwargs})


def config_honouring_layer_spec() -> ModuleSpec:
    """``blockdiag_cp_gpt_layer_spec``: a ModuleSpec whose layers follow the config they are built with."""
    template = get_gpt_layer_spec_with_blockdiag_cp()
    return ModuleSpec(module=BlockDiagCPTransformerLayer, params=dict(template.params),
                      submodules=template.submodules)
