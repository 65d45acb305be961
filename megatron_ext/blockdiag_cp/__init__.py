"""The block-diagonal CP engine: knows nothing of Megatron models."""

from . import state
from .batch import blockdiag_cp_step, doc_ids_from_cu_seqlens, doc_ids_from_eod, shard_batch
from .runtime import BlockDiagCPError, BlockDiagCPState, blockdiag_cp_attention
from .state import (
    configure_cp_varlen,
    cp_attn_fire_count,
    cp_varlen_runtime_config,
    normalize_attn_backend,
    normalize_kv_exchange,
    normalize_layout,
    reset_cp_attn_fire_count,
)

# What users call. Test hooks (kernel overrides, availability overrides) are not here: tests
# reach them through megatron_ext.testing. The documented state module is
# megatron_ext.blockdiag_cp.state.
__all__ = [
    # data path
    "shard_batch", "blockdiag_cp_step", "doc_ids_from_eod", "doc_ids_from_cu_seqlens",
    # the step state and the attention op
    "BlockDiagCPState", "BlockDiagCPError", "blockdiag_cp_attention",
    # knobs
    "configure_cp_varlen", "cp_varlen_runtime_config",
    "normalize_attn_backend", "normalize_kv_exchange", "normalize_layout",
    # fire counter
    "cp_attn_fire_count", "reset_cp_attn_fire_count",
]
