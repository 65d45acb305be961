"""Document-id cases shared by the distributed engine tests (deterministic)."""

import torch

from .reference import runs_to_doc_ids


def make_doc_ids(case: str, S: int, cp: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    if case == "short":
        runs, i, n = [], 1, 0
        while n < S:
            length = min(int(torch.randint(1, 13, (1,), generator=g)), S - n)
            runs.append((i, length))
            i, n = i + 1, n + length
        return runs_to_doc_ids(runs)
    if case == "single":
        return torch.ones(S, dtype=torch.int64)
    if case == "pad_tail":  # whole shards of only padding
        return runs_to_doc_ids([(1, 7), (2, 13), (0, S - 20)])
    if case == "len1_boundaries":
        L, chunk = S // cp, S // (2 * cp)
        cuts = sorted({0, S} | {c for c in range(chunk, S, chunk)})
        runs, i = [], 1
        for a, b in zip(cuts[:-1], cuts[1:]):
            # a length-1 document on each side of every shard/chunk boundary
            runs += [(i, 1), (i + 1, b - a - 2), (i + 2, 1)]
            i += 3
        assert L % chunk == 0
        return runs_to_doc_ids([r for r in runs if r[1] > 0])
    if case == "pad_middle":
        return runs_to_doc_ids([(1, 11), (0, 17), (2, 5), (3, S // 2 - 33), (0, 3), (4, S - S // 2 - 3)])
    if case == "same_id_twice":  # id 1 in two separate runs = two documents
        return runs_to_doc_ids([(1, S // 4), (2, S // 4), (1, S // 4), (2, S - 3 * (S // 4))])
    if case == "uneven":  # S not a multiple of the layout granularity: shard pads
        return runs_to_doc_ids([(1, 30), (2, S - 35)])
    if case == "b2":  # per-row document ids
        row0 = make_doc_ids("short", S, cp)
        row1 = runs_to_doc_ids([(1, S // 3), (2, S - S // 3 - 6), (0, 6)])
        return torch.stack([row0, row1])
    raise KeyError(case)


CASES = ["short", "single", "pad_tail", "len1_boundaries", "pad_middle", "same_id_twice",
         "uneven", "b2"]
