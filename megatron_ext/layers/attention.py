"""BlockDiagCPAttention: megatron-core core attention for packed documents under CP."""

import math
from typing import Optional

from torch import Tensor

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from .. import parallel_state as ps
from ..blockdiag_cp import BlockDiagCPError, blockdiag_cp_attention
from ..blockdiag_cp.resolve import resolve_step_state

# Causal within each document is what the plan computes; Megatron's padding_causal (THD, SFT)
# is the same here, padding being positions outside every document.
SUPPORTED_MASK_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal)


class BlockDiagCPAttention(MegatronModule):
    """Per-document causal core attention; with CP > 1 it exchanges K/V over the CP group.

    Drop-in for megatron-core's ``DotProductAttention``: same constructor, same
    forward, query [sq, b, np, hn] -> output [sq, b, np * hn] (THD: [t, np, hn] ->
    [t, np * hn]). The step state is resolved per microbatch, in this order: ours
    in ``packed_seq_params.blockdiag_state``; one built from THD ``packed_seq_params``;
    one derived from Megatron's per-document causal ``attention_mask``; the state
    published by ``blockdiag_cp_step``. Self-attention with a causal mask type only.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        self.config = config
        self.layer_number = max(1, layer_number)
        self._check_mask_type(attn_mask_type)
        if attention_type != "self":
            raise BlockDiagCPError(
                f"BlockDiagCPAttention is self-attention only (attention_type={attention_type!r}); "
                "use megatron's own core attention for cross attention")
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.cp_comm_type = cp_comm_type  # accepted for spec compatibility; the plan decides

        tp_size = pg_collection.tp.size() if pg_collection is not None and hasattr(pg_collection, "tp") \
            else ps.get_tp_world_size()
        self.cp_group = pg_collection.cp if pg_collection is not None and hasattr(pg_collection, "cp") \
            else None
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)
        self.hidden_size_per_attention_head = divide(config.kv_channels * config.num_attention_heads,
                                                     config.num_attention_heads)
        # query-key layer scaling divides the scores by layer_number and multiplies them back
        # inside the fp32 softmax (megatron's FusedScaleMaskSoftmax): the net scale is unchanged,
        # and our kernels always take the softmax in fp32.
        if softmax_scale is None:
            softmax_scale = getattr(config, "softmax_scale", None)
        self.softmax_scale = (1.0 / math.sqrt(self.hidden_size_per_attention_head)
                              if softmax_scale is None else softmax_scale)
        self.attention_dropout_p = config.attention_dropout if attention_dropout is None \
            else attention_dropout
        self._check_cp_size()

    def _group(self):
        return self.cp_group if self.cp_group is not None else ps.get_cp_group()

    def _check_cp_size(self) -> None:
        group = self._group()
        size = ps.group_size(group)
        if group is None and self.config.context_parallel_size > 1:
            ps.require_cp_group()  # raises: CP asked for, no process group
        if group is not None and size != self.config.context_parallel_size:
            raise BlockDiagCPError(
                f"TransformerConfig.context_parallel_size={self.config.context_parallel_size} but the "
                f"CP process group has {size} ranks; initialize parallel_state with "
                f"context_parallel_size={self.config.context_parallel_size} or fix the config")

    @staticmethod
    def _check_mask_type(attn_mask_type) -> None:
        if attn_mask_type is not None and attn_mask_type not in SUPPORTED_MASK_TYPES:
            raise BlockDiagCPError(
                f"BlockDiagCPAttention computes causal attention within each document; "
                f"attn_mask_type={attn_mask_type} is not supported (supported: "
                f"{', '.join(t.name for t in SUPPORTED_MASK_TYPES)}). Bidirectional (no_mask, padding) "
                "and arbitrary masks need megatron's own core attention")

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise BlockDiagCPError("attention_bias is not supported by BlockDiagCPAttention")
        self._check_mask_type(attn_mask_type)
        group = self._group()
        self._check_cp_size()
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if thd:  # megatron squeezed the batch dim: [t, h, d] -> [t, 1, h, d]
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
        state = resolve_step_state(packed_seq_params, attention_mask, cp_group=group,
                                   local_tokens=query.shape[0], batch=query.shape[1], device=query.device)
        if state is not None and state.cp > 1:
            self._check_state_group(state, group)
        dropout_p = self.attention_dropout_p if self.training else 0.0
        out = blockdiag_cp_attention(query, key, value, softmax_scale=self.softmax_scale,
                                     dropout_p=dropout_p, state=state, cp_group=group)
        sq, b, np_, hn = out.shape
        if thd:
            return out.reshape(sq, np_ * hn)  # [t, np * hn]; megatron adds the batch dim back
        return out.reshape(sq, b, np_ * hn)  # [sq, b, np * hn]

    @staticmethod
    def _check_state_group(state, group) -> None:
        import torch.distributed as dist

        if group is None or dist.get_process_group_ranks(state.group) != dist.get_process_group_ranks(group):
            theirs = "no group" if group is None else dist.get_process_group_ranks(group)
            raise BlockDiagCPError(
                f"the step state was built for CP ranks {dist.get_process_group_ranks(state.group)} "
                f"but this layer's CP group is {theirs}; build the state with this model's CP group "
                "(shard_batch(..., cp_group=parallel_state.get_context_parallel_group()))")
