"""The block-diagonal CP engine: knows nothing of Megatron models."""

from . import state
from .agreement import BlockDiagCPError
from .attention_op import blockdiag_cp_attention
from .batch import blockdiag_cp_step, doc_ids_from_cu_seqlens, doc_ids_from_eod, shard_batch
from .cost import CostModel, WindowMix, default_cost_model
from .layout import thd_partitioned_indices
from .prepare import PreparedPlan, plan_summary, prepare_plan
from .resolve import resolve_step_state
from .state import (
    configure_cp_kv_backward,
    configure_cp_layout,
    configure_cp_strict,
    configure_cp_thd_partition,
    configure_cp_varlen,
    cp_attn_fire_count,
    cp_kv_backward_runtime_config,
    cp_layout_runtime_config,
    cp_strict_runtime_config,
    cp_varlen_runtime_config,
    normalize_attn_backend,
    normalize_kv_backward,
    normalize_kv_exchange,
    normalize_layout,
    reset_cp_attn_fire_count,
)
from .step import BlockDiagCPState

# What users call. Test hooks (kernel overrides, availability overrides) are not here: tests
# reach them through megatron_ext.testing. The documented state module is
# megatron_ext.blockdiag_cp.state.
__all__ = [
    # data path
    "shard_batch", "blockdiag_cp_step", "doc_ids_from_eod", "doc_ids_from_cu_seqlens", "resolve_step_state",
    # the step state and the attention op
    "BlockDiagCPState", "BlockDiagCPError", "blockdiag_cp_attention",
    # knobs
    "configure_cp_varlen", "cp_varlen_runtime_config", "configure_cp_layout", "cp_layout_runtime_config",
    "configure_cp_thd_partition", "normalize_attn_backend", "normalize_kv_exchange", "normalize_layout",
    "configure_cp_kv_backward", "cp_kv_backward_runtime_config", "normalize_kv_backward",
    "configure_cp_strict", "cp_strict_runtime_config",
    # planning ahead and to look
    "CostModel", "default_cost_model", "WindowMix", "PreparedPlan", "prepare_plan", "plan_summary",
    "thd_partitioned_indices",
    # fire counter
    "cp_attn_fire_count", "reset_cp_attn_fire_count",
]
