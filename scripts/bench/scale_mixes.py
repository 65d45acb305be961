"""Document-length mixes of the scale suite: deterministic doc ids [S], 1-based.

- ``lognormal``: lengths exp(N(log 2048, 1.2)), at least 1 token;
- ``short``: lengths uniform in [32, 2048];
- ``heavy``: one document of exactly S/4 at a seeded place among lognormal
  median-512 (sigma 1.2) documents.

The last document is cut to fit S. Lengths are drawn in one vectorized batch, so
a 1M-token sequence costs milliseconds.
"""

import math
from typing import List

import torch

SCALE_MIXES = ("lognormal", "short", "heavy")


def _draw(g: torch.Generator, kind: str, median: float, n: int) -> torch.Tensor:
    if kind == "short":
        return torch.randint(32, 2049, (n,), generator=g)
    x = torch.exp(math.log(median) + 1.2 * torch.randn(n, generator=g, dtype=torch.float64))
    return x.clamp(min=1).long()


def _fill(g: torch.Generator, kind: str, median: float, total: int) -> List[int]:
    out: List[int] = []
    need = total
    while need > 0:
        batch = _draw(g, kind, median, max(64, 4 * need // int(median) + 16))
        cum = batch.cumsum(0)
        cut = int(torch.searchsorted(cum, torch.tensor(need)))  # first index reaching need
        if cut < batch.numel():
            taken = batch[:cut + 1].tolist()
            taken[-1] -= int(cum[cut]) - need
            out += taken
            return out
        out += batch.tolist()
        need -= int(cum[-1])
    return out


def scale_doc_lengths(mix: str, S: int, seed: int = 0) -> List[int]:
    code = {"lognormal": 11, "short": 12, "heavy": 13}
    if mix not in code:
        raise KeyError(f"unknown scale mix {mix!r}; known: {SCALE_MIXES}")
    g = torch.Generator().manual_seed(1000 * seed + code[mix])
    if mix == "lognormal":
        return _fill(g, "lognormal", 2048, S)
    if mix == "short":
        return _fill(g, "short", 1040, S)
    heavy = S // 4
    others = _fill(g, "lognormal", 512, S - heavy)
    where = int(torch.randint(0, len(others) + 1, (1,), generator=g))
    return others[:where] + [heavy] + others[where:]


def scale_doc_ids(mix: str, S: int, seed: int = 0) -> torch.Tensor:
    lengths = scale_doc_lengths(mix, S, seed)
    assert sum(lengths) == S and min(lengths) > 0, (mix, S)
    return torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))
