"""Document-length mixes for the benchmarks and the GPU check: deterministic doc ids [S] (1-based).

- ``short``: many short documents, lengths uniform in [64, 1024];
- ``heavy_tail``: lognormal lengths (median 512, sigma 1.2, clipped to [16, S/2])
  plus one document of exactly S/2 at a seeded place, so every S has a few very
  long documents next to many short ones;
- ``single``: one document of length S;
- ``packed_mix``: log-uniform lengths in [min_len, max_len], about 8% length-1
  documents and an optional padded tail (id 0): the GPU check's realistic pack.

Every mix depends only on its arguments and seed: all ranks build the same ids.
"""

import math
from typing import List

import torch

MIXES = ("short", "heavy_tail", "single")
SEQ_LENS = (4096, 8192, 16384, 32768)


def _fill(lengths_iter, S: int) -> List[int]:
    out, n = [], 0
    for length in lengths_iter:
        length = min(int(length), S - n)
        out.append(length)
        n += length
        if n >= S:
            return out
    raise AssertionError("length generator ran dry")


def doc_lengths(mix: str, S: int, seed: int = 0) -> List[int]:
    g = torch.Generator().manual_seed(1000 * seed + {"short": 1, "heavy_tail": 2, "single": 3}[mix])
    if mix == "single":
        return [S]
    if mix == "short":
        def gen():
            while True:
                yield int(torch.randint(64, 1025, (1,), generator=g))
        return _fill(gen(), S)
    if mix == "heavy_tail":
        half = S // 2
        rest = S - half

        def gen():
            while True:
                x = math.exp(math.log(512) + 1.2 * float(torch.randn(1, generator=g)))
                yield max(16, min(half, int(x)))
        others = _fill(gen(), rest)
        where = int(torch.randint(0, len(others) + 1, (1,), generator=g))
        return others[:where] + [half] + others[where:]
    raise KeyError(f"unknown mix {mix!r}; known: {MIXES}")


def make_doc_ids(mix: str, S: int, seed: int = 0) -> torch.Tensor:
    lengths = doc_lengths(mix, S, seed)
    assert sum(lengths) == S, (mix, S, sum(lengths))
    return torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))


def packed_mix(S: int, seed: int, min_len: int, max_len: int, pad_tail: int = 0) -> torch.Tensor:
    """[S] doc ids: log-uniform document lengths, a few length-1 documents, ``pad_tail`` padding."""
    g = torch.Generator().manual_seed(seed)
    runs, n, doc = [], 0, 1
    body = S - pad_tail
    while n < body:
        if float(torch.rand(1, generator=g)) < 0.08:
            length = 1
        else:
            u = float(torch.rand(1, generator=g))
            length = int(math.exp(math.log(min_len) + u * (math.log(max_len) - math.log(min_len))))
        length = max(1, min(length, body - n))
        runs.append(torch.full((length,), doc, dtype=torch.int64))
        n, doc = n + length, doc + 1
    runs.append(torch.zeros(pad_tail, dtype=torch.int64))
    return torch.cat(runs)


def describe(mix: str, S: int, seed: int = 0) -> dict:
    lengths = doc_lengths(mix, S, seed)
    return {"num_docs": len(lengths), "max_doc": max(lengths), "min_doc": min(lengths)}
