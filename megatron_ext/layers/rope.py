"""RoPE under block-diagonal CP: every token rotated by its own global (or in-document) position.

megatron-core's ``RotaryEmbedding`` slices its table in the zigzag layout and
moves it to CUDA; ``BlockDiagRotaryEmbedding`` takes the table rows of the
published state's ``local_positions`` instead, for any layout, on any device.
"""

import torch

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from ..blockdiag_cp.layouts import document_starts
from ..blockdiag_cp.resolve import resolve_step_state


def rope_positions(state, reset_position_ids: bool = False) -> torch.Tensor:
    """The position each of this rank's tokens is rotated by.

    [local_len] global padded positions; with ``reset_position_ids`` the position
    inside the document (Megatron's reset-position-ids rule): [local_len], or
    [local_len, b] when the batch rows have their own doc ids.
    """
    positions = state.local_positions
    if not reset_position_ids:
        return positions
    starts = document_starts(state.doc_ids)[:, positions]  # [R, local_len]
    within = positions.unsqueeze(0) - starts
    return within[0] if state.rows == 1 else within.t().contiguous()


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
        state = resolve_step_state()
        if state is None or state.cp == 1 and not self.reset_position_ids:
            return self.get_emb(max_seq_len, offset)
        positions = rope_positions(state, self.reset_position_ids).to(self.inv_freq.device)
        table = self.get_emb(max(state.padded_len, max_seq_len), offset)  # [P, 1, 1, dim]
        emb = table.index_select(0, positions.reshape(-1))
        # Per-row positions broadcast over heads: [s, b, 1, dim] against q/k [s, b, h, d].
        return emb if positions.dim() == 1 else emb.view(positions.shape[0], positions.shape[1], 1, -1)


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
