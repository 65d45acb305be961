"""BlockDiagCPAttention: megatron-core core attention for packed documents under CP."""

import math
from typing import Optional

import torch
from torch import Tensor

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from .. import parallel_state as ps
from ..blockdiag_cp import BlockDiagCPError, blockdiag_cp_attention
from ..blockdiag_cp.state import current_blockdiag_state


class BlockDiagCPAttention(MegatronModule):
    """Per-document causal core attention; with CP > 1 it exchanges K/V over the CP group.

    Drop-in for megatron-core's ``DotProductAttention``: same constructor, same
    forward, query [sq, b, np, hn] -> output [sq, b, np * hn]. The step state comes
    from ``packed_seq_params.blockdiag_state`` when present (so recompute sees its
    own microbatch), else from the state published by ``blockdiag_cp_step``.
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
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            raise BlockDiagCPError(
                "BlockDiagCPAttention takes sbhd tensors; pass packed_seq_params_for(state) "
                "(megatron_ext.layers) instead of THD packed_seq_params")
        state = getattr(packed_seq_params, "blockdiag_state", None) or current_blockdiag_state()
        group = self._group()
        self._check_cp_size()
        if state is not None and state.cp > 1:
            self._check_state_group(state, group)
        dropout_p = self.attention_dropout_p if self.training else 0.0
        if state is None and attention_mask is not None and ps.group_size(group) == 1:
            out = self._masked_attention(query, key, value, attention_mask, dropout_p)
        else:
            out = blockdiag_cp_attention(query, key, value, softmax_scale=self.softmax_scale,
                                         dropout_p=dropout_p, state=state, cp_group=group)
        sq, b, np_, hn = out.shape
        return out.reshape(sq, b, np_ * hn)  # [sq, b, np * hn]

    @staticmethod
    def _check_state_group(state, group) -> None:
        import torch.distributed as dist

        if group is None or dist.get_process_group_ranks(state.group) != dist.get_process_group_ranks(group):
            theirs = "no group" if group is None else dist.get_process_group_ranks(group)
            raise BlockDiagCPError(
                f"the published state was built for CP ranks {dist.get_process_group_ranks(state.group)} "
                f"but this layer's CP group is {theirs}; build the state with this model's CP group "
                "(shard_batch(..., cp_group=parallel_state.get_context_parallel_group()))")

    def _masked_attention(self, q, k, v, attention_mask, dropout_p):
        # CP = 1 without a state, with megatron's mask (True = masked out) plus causality.
        sq, sk = q.shape[0], k.shape[0]
        allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        allowed = allowed & ~attention_mask.to(torch.bool)  # [b or 1, 1, sq, sk]
        qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, s, d]
        out = torch.nn.functional.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=allowed, scale=self.softmax_scale, dropout_p=dropout_p,
            enable_gqa=q.shape[2] != k.shape[2])
        return torch.nan_to_num(out).permute(2, 0, 1, 3)
