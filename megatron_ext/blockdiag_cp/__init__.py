"""The block-diagonal CP engine: knows nothing of Megatron models.

The knobs (``state``) import nothing; every other public name is imported from its submodule on
first use (the module ``__getattr__`` below), so ``import megatron_ext.blockdiag_cp.state`` -- what
the flag parsers check values with -- does not import torch.
"""

import importlib

from . import state
from .state import (
    configure_cp_kv_backward,
    configure_cp_layout,
    configure_cp_relayout,
    configure_cp_strict,
    configure_cp_thd_partition,
    configure_cp_ulysses_size,
    configure_cp_varlen,
    cp_attn_fire_count,
    cp_kv_backward_runtime_config,
    cp_layout_runtime_config,
    cp_relayout_runtime_config,
    cp_strict_runtime_config,
    cp_ulysses_size_runtime_config,
    cp_varlen_runtime_config,
    normalize_attn_backend,
    normalize_kv_backward,
    normalize_kv_exchange,
    normalize_layout,
    normalize_relayout,
    reset_cp_attn_fire_count,
)

# The public names that need torch -> the submodule that defines them.
_LAZY = {
    "BlockDiagCPError": "agreement",
    "blockdiag_cp_attention": "attention_op",
    "blockdiag_cp_step": "batch", "doc_ids_from_cu_seqlens": "batch", "doc_ids_from_eod": "batch",
    "shard_batch": "batch",
    "CostModel": "cost", "WindowMix": "cost", "default_cost_model": "cost",
    "thd_partitioned_indices": "layouts.thd",
    "PreparedPlan": "prepare", "plan_summary": "prepare", "prepare_plan": "prepare",
    "resolve_step_state": "resolve",
    "BlockDiagCPState": "step",
}

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
    "configure_cp_ulysses_size", "cp_ulysses_size_runtime_config",
    "configure_cp_relayout", "cp_relayout_runtime_config", "normalize_relayout",
    # planning ahead and to look
    "CostModel", "default_cost_model", "WindowMix", "PreparedPlan", "prepare_plan", "plan_summary",
    "thd_partitioned_indices",
    # fire counter
    "cp_attn_fire_count", "reset_cp_attn_fire_count",
]


def __getattr__(name: str):
    """A public name from its submodule, or a submodule itself (``bdcp.resolve``), imported now and kept."""
    if name.startswith("_"):  # dunder probes (copy, inspect, pytest): no submodule is named so
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    else:
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
