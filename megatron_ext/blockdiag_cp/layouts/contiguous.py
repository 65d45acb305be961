"""The contiguous layout: rank r owns the r-th block of the padded sequence."""

import torch

from .base import LayoutStrategy


class ContiguousLayout(LayoutStrategy):
    """Rank r owns the r-th contiguous block.

    cp = 4, P = 16:   | 0 0 0 0 | 1 1 1 1 | 2 2 2 2 | 3 3 3 3 |

    Causal work grows towards the end: the last rank does the most.
    """

    name = "contiguous"

    def runs(self, doc_ids, cp, cost_model, windows=None, doc_runs=None):
        L = doc_ids.shape[-1] // cp
        return torch.arange(cp), torch.arange(cp) * L, torch.full((cp,), L)
