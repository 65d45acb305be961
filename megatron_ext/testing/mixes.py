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


# ---------------------------------------------------------------------------
# Worst-case planning mixes (issue 19): random parameters, drawn once per seed
# ---------------------------------------------------------------------------

WORST_CASE_KINDS = ("lognormal", "uniform", "heavy", "single")


def worst_case_mix_params(count: int = 24, seed: int = 0) -> List[dict]:
    """``count`` mix descriptions: about half lognormal (sigma 0.5-1.5, median 256-8192, log-uniform),
    uniform lengths in [lo, hi] (lo 1-256, hi 1k-8k), heavy-tailed (one document of S/8-S/2 at a
    random place among lognormal ones) and one single document. Deterministic in ``seed``."""
    g = torch.Generator().manual_seed(7919 + seed)
    u = lambda lo, hi: lo + (hi - lo) * float(torch.rand(1, generator=g))  # noqa: E731
    logu = lambda lo, hi: math.exp(u(math.log(lo), math.log(hi)))  # noqa: E731
    n_single, n_uniform = 1, max(1, count // 6)
    n_heavy = max(1, (count - n_single - n_uniform) // 2 - 1)
    n_lognormal = count - n_single - n_uniform - n_heavy
    out = []
    for i in range(n_lognormal):
        out.append({"kind": "lognormal", "sigma": round(u(0.5, 1.5), 2), "median": int(logu(256, 8192)),
                    "seed": i})
    for i in range(n_uniform):
        out.append({"kind": "uniform", "lo": int(logu(1, 256)), "hi": int(logu(1024, 8192)), "seed": i})
    for i in range(n_heavy):
        out.append({"kind": "heavy", "fraction": round(u(1 / 8, 1 / 2), 3), "sigma": round(u(0.5, 1.5), 2),
                    "median": int(logu(256, 8192)), "seed": i})
    out.append({"kind": "single", "seed": 0})
    return out


def mix_name(params: dict) -> str:
    """A short stable label: lognormal(s=1.2,m=2048)#3, uniform(1-4096)#0, heavy(f=0.25,...)#1, single."""
    k = params["kind"]
    if k == "single":
        return "single"
    if k == "uniform":
        return f"uniform({params['lo']}-{params['hi']})#{params['seed']}"
    if k == "lognormal":
        return f"lognormal(s={params['sigma']},m={params['median']})#{params['seed']}"
    return f"heavy(f={params['fraction']},s={params['sigma']},m={params['median']})#{params['seed']}"


def worst_case_doc_lengths(params: dict, S: int) -> List[int]:
    """Document lengths (sum S) of one ``worst_case_mix_params`` entry; vectorized draws."""
    k = params["kind"]
    g = torch.Generator().manual_seed(104729 * (1 + params.get("seed", 0)) + WORST_CASE_KINDS.index(k))

    def lognormal(total: int) -> List[int]:
        out, need = [], total
        while need > 0:
            n = max(64, 4 * need // params["median"] + 16)
            x = torch.exp(math.log(params["median"]) + params["sigma"] * torch.randn(n, generator=g,
                                                                                 dtype=torch.float64))
            out += _take(x.clamp(min=1).long(), need)
            need = total - sum(out)
        return out

    if k == "single":
        return [S]
    if k == "uniform":
        out, need = [], S
        while need > 0:
            out += _take(torch.randint(params["lo"], params["hi"] + 1, (max(64, 2 * need // params["lo"] + 16),),
                                       generator=g), need)
            need = S - sum(out)
        return out
    if k == "lognormal":
        return lognormal(S)
    heavy = max(1, int(S * params["fraction"]))
    others = lognormal(S - heavy) if S > heavy else []
    where = int(torch.randint(0, len(others) + 1, (1,), generator=g))
    return others[:where] + [heavy] + others[where:]


def _take(lengths: torch.Tensor, need: int) -> List[int]:
    """The prefix of ``lengths`` that reaches ``need`` tokens, the last one cut to fit."""
    cum = lengths.cumsum(0)
    cut = int(torch.searchsorted(cum, torch.tensor(need)))
    if cut >= lengths.numel():
        return lengths.tolist()
    taken = lengths[:cut + 1].tolist()
    taken[-1] -= int(cum[cut]) - need
    return taken


def worst_case_doc_ids(params: dict, S: int) -> torch.Tensor:
    lengths = worst_case_doc_lengths(params, S)
    assert sum(lengths) == S and min(lengths) > 0, (params, S)
    return torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))
