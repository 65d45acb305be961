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


# (real lengths, padded extents in units of 2cp): a document of length 0 keeps its padded
# extent (packers emit these), or has none (extent 0). At cp = 2 the first two are issue 32's
# cu_seqlens [0, 5, 5, 11] / [0, 8, 12, 20] and [0, 5, 11, 11] / [0, 8, 16, 20].
THD_EMPTY_DOCUMENT_CASES = {
    "empty_middle": ((5, 0, 6), (2, 1, 2)),
    "empty_trailing": ((5, 6, 0), (2, 2, 1)),
    "empty_first": ((0, 5, 6), (1, 2, 2)),
    "several_empty": ((0, 3, 0, 0, 7, 0), (1, 1, 2, 1, 2, 1)),
    "zero_extent": ((5, 0, 6), (2, 0, 2)),
    "full_then_empty": ((4, 0, 3, 0), (1, 1, 1, 2)),
}


def thd_case(name, cp):
    """(cu_seqlens [n + 1], cu_seqlens_padded [n + 1], doc ids [T]) of a case at cp, built from its
    definition: document i + 1's tokens at the start of its padded extent, padding (0) after them."""
    lengths, units = THD_EMPTY_DOCUMENT_CASES[name]
    cu = torch.tensor((0,) + lengths).cumsum(0).to(torch.int32)
    cu_padded = torch.tensor([0] + [u * 2 * cp for u in units]).cumsum(0).to(torch.int32)
    return cu, cu_padded, thd_doc_ids(cu, cu_padded)


def thd_doc_ids(cu_seqlens, cu_seqlens_padded) -> torch.Tensor:
    """[T] doc ids of a THD pack: document i + 1's tokens at the start of its padded extent, 0 after."""
    lengths, extents = cu_seqlens.diff().tolist(), cu_seqlens_padded.diff().tolist()
    return torch.cat([torch.cat([torch.full((n,), i + 1), torch.zeros(e - n, dtype=torch.long)])
                      for i, (n, e) in enumerate(zip(lengths, extents))])
