"""Megatron-facing layers: BlockDiagCPAttention, packed params, RoPE and GPT layer specs."""

from .attention import BlockDiagCPAttention
from .packed import BlockDiagPackedSeqParams, packed_seq_params_for
from .rope import BlockDiagRotaryEmbedding, rope_positions, use_blockdiag_rope
from .specs import (
    get_gpt_layer_spec_with_blockdiag_cp,
    nvidia_apex_available,
    transformer_engine_available,
    with_blockdiag_core_attention,
)

__all__ = [
    "BlockDiagCPAttention", "BlockDiagPackedSeqParams", "BlockDiagRotaryEmbedding",
    "get_gpt_layer_spec_with_blockdiag_cp", "nvidia_apex_available", "packed_seq_params_for",
    "rope_positions", "transformer_engine_available", "use_blockdiag_rope",
    "with_blockdiag_core_attention",
]
