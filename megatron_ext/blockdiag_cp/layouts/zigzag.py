"""The zigzag layout: megatron-core's cut of one sequence into 2 * cp chunks."""

import torch

from .base import LayoutStrategy


class ZigzagLayout(LayoutStrategy):
    """megatron-core's get_batch_on_this_cp_rank: 2*cp chunks, rank r owns r and 2*cp-1-r.

    cp = 4, P = 16:   | 0 0 | 1 1 | 2 2 | 3 3 | 3 3 | 2 2 | 1 1 | 0 0 |

    Balanced for one causal document; blind to document boundaries.
    """

    name = "zigzag"

    @staticmethod
    def granularity(cp: int) -> int:
        return 2 * cp if cp > 1 else cp

    def runs(self, doc_ids, cp, cost_model, windows=None, doc_runs=None):
        half = doc_ids.shape[-1] // (2 * cp)
        rank = torch.arange(cp)
        chunk = torch.stack([rank, 2 * cp - 1 - rank], 1)  # [cp, 2]
        return rank.repeat_interleave(2), chunk.reshape(-1) * half, torch.full((2 * cp,), half)
