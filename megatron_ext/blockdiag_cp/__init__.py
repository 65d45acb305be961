"""The block-diagonal CP engine: knows nothing of Megatron models."""

from . import state
from .agreement import BlockDiagCPError
from .attention_op import blockdiag_cp_attention
from .batch import blockdiag_cp_step, doc_ids_from_cu_seqlens, doc_ids_from_eod, shard_batch
from .cost import CostModel, default_cost_model
from .layout import thd_partitioned_indices
from .prepare import PreparedPlan, plan_summary, prepare_plan
from .resolve import resolve_step_state
from .state import (
    configure_cp_layout,
    configure_cp_thd_partition,
    configure_cp_varlen,
    cp_attn_fire_count,
    cp_layout_runtime_config,
    cp_varlen_runtime_config,
    normalize_attn_backend,
    normalize_kv_exchange,
    normalize_layout,
    reset_cp_attn_fire_count,
)
from .step import BlockDiagCPState

__all__ = [
    "BlockDiagCPError", "BlockDiagCPState", "CostModel", "PreparedPlan", "blockdiag_cp_attention",
    "blockdiag_cp_step", "configure_cp_layout", "configure_cp_thd_partition", "configure_cp_varlen",
    "cp_attn_fire_count", "cp_layout_runtime_config", "cp_varlen_runtime_config", "default_cost_model",
    "doc_ids_from_cu_seqlens", "doc_ids_from_eod", "normalize_attn_backend", "normalize_kv_exchange",
    "normalize_layout", "plan_summary", "prepare_plan", "reset_cp_attn_fire_count", "resolve_step_state",
    "shard_batch", "state", "thd_partitioned_indices",
]
