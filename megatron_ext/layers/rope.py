"""RoPE under block-diagonal CP: every token rotated by its own global (or in-document) position.

megatron-core's ``RotaryEmbedding`` slices its table in the zigzag layout and
moves it to CUDA; ``BlockDiagRotaryEmbedding`` takes the table rows of the
published state's ``local_positions`` instead, for any layout, on any device.
"""

import torch

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from ..blockdiag_cp.layout import document_starts
from ..blockdiag_cp.state import current_blockdiag_state


def rope_positions(state, reset_position_ids: bool = False) -> torch.Tensor:
    """[local_len] the position each of this rank's tokens is rotated by.

    Global padded positions, or with ``reset_position_ids`` the position inside
    the document (Megatron's reset-position-ids rule; doc ids must then be shared
    by all batch rows).
    """
    positions = state.local_positions
    if not reset_position_ids:
        return positions
    if state.rows != 1:
        raise ValueError("reset_position_ids with RoPE needs doc ids shared by every batch row "
                         f"(the state has {state.rows} rows)")
    starts = document_starts(state.doc_ids)[0]
    return positions - starts[positions]


class BlockDiagRotaryEmbedding(RotaryEmbedding):
    """RotaryEmbedding whose CP slicing follows the published state's layout."""

    reset_position_ids = False

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # on inv_freq's device
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :]  # [s, 1, 1, dim]

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        state = current_blockdiag_state()
        if state is None or state.cp == 1 and not self.reset_position_ids:
            return self.get_emb(max_seq_len, offset)
        positions = rope_positions(state, self.reset_position_ids)
        table = self.get_emb(max(state.padded_len, max_seq_len), offset)
        return table.index_select(0, positions.to(table.device))


def use_blockdiag_rope(model, reset_position_ids: bool = False):
    """Make a GPTModel's RoPE follow the block-diagonal CP layout (any layout)."""
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is None:
        raise ValueError("the model has no rotary_pos_emb (position_embedding_type is not 'rope')")
    if not isinstance(rope, RotaryEmbedding):
        raise ValueError(f"unsupported rotary embedding {type(rope).__name__} for block-diagonal CP")
    rope.__class__ = BlockDiagRotaryEmbedding
    rope.reset_position_ids = reset_position_ids
    return model
