"""The block-diagonal CP engine: knows nothing of Megatron models."""

from . import state
from .batch import blockdiag_cp_step, doc_ids_from_cu_seqlens, doc_ids_from_eod, shard_batch
from .cost import CostModel, default_cost_model
from .layout import thd_partitioned_indices
from .prepare import PreparedPlan, plan_summary, prepare_plan
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

__all__ = [
    "CostModel", "PreparedPlan", "default_cost_model", "plan_summary", "prepare_plan",
    "thd_partitioned_indices", "BlockDiagCPError", "BlockDiagCPState", "blockdiag_cp_attention", "blockdiag_cp_step",
    "configure_cp_varlen", "cp_attn_fire_count", "cp_varlen_runtime_config",
    "doc_ids_from_cu_seqlens", "doc_ids_from_eod", "normalize_attn_backend",
    "normalize_kv_exchange", "normalize_layout", "reset_cp_attn_fire_count", "shard_batch", "state",
]
