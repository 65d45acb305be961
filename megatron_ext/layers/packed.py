"""PackedSeqParams that carry the step state through Megatron's forward arguments.

Megatron's selective recompute (``Attention._checkpointed_attention_forward``)
closes over ``packed_seq_params``, and pipeline schedules run microbatch i's
backward after later microbatches' forwards. Carrying the state here lets each
recompute see its own microbatch; the thread-shared holder is the fallback.
``qkv_format`` stays "sbhd" so Megatron does not take its THD code paths.
"""

from dataclasses import dataclass
from typing import Any, Optional

from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class BlockDiagPackedSeqParams(PackedSeqParams):
    blockdiag_state: Optional[Any] = None


def packed_seq_params_for(state) -> BlockDiagPackedSeqParams:
    """The ``packed_seq_params`` to pass to ``GPTModel.forward`` for this step's state."""
    # cp_group stays None: megatron's RoPE would otherwise zigzag-slice its table itself.
    return BlockDiagPackedSeqParams(qkv_format="sbhd", blockdiag_state=state,
                                    max_seqlen_q=state.padded_len, max_seqlen_kv=state.padded_len)
