"""Megatron-facing layers: BlockDiagCPAttention, packed params, RoPE and GPT layer specs."""

from .attention import BlockDiagCPAttention
from .packed import BlockDiagPackedSeqParams, packed_seq_params_for
from .rope import BlockDiagRotaryEmbedding, rope_positions, use_blockdiag_rope
from .specs import (
    BlockDiagCPTransformerLayer,
    config_honouring_layer_spec,
    get_gpt_layer_spec_with_blockdiag_cp,
    megatron_layer_spec_for,
    nvidia_apex_available,
    transformer_engine_available,
    with_blockdiag_core_attention,
)



def __getattr__(name):
    # ``--spec megatron_ext.layers blockdiag_cp_gpt_layer_spec``: megatron resolves the attribute with
    # spec_utils.import_module and hands it to GPTModel uncalled (the legacy gpt_builder route) or
    # uses it as is (GPTModelBuilder), so it is a ModuleSpec; its layer module reads the config each
    # layer is built with. Built on first access (TE is imported only then) and kept.
    if name == "blockdiag_cp_gpt_layer_spec":
        spec = config_honouring_layer_spec()
        globals()[name] = spec
        return spec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BlockDiagCPAttention", "BlockDiagCPTransformerLayer", "BlockDiagPackedSeqParams",
    "BlockDiagRotaryEmbedding", "blockdiag_cp_gpt_layer_spec", "config_honouring_layer_spec",
    "megatron_layer_spec_for",
    "get_gpt_layer_spec_with_blockdiag_cp", "nvidia_apex_available", "packed_seq_params_for",
    "rope_positions", "transformer_engine_available", "use_blockdiag_rope",
    "with_blockdiag_core_attention",
]
