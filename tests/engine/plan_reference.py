"""The planner as it was before the interval rewrite (issue 10): O(cp * P) masks per destination.

Kept verbatim in behaviour as the reference the new ``plan.build_plan`` must equal, field for
field, on random document ids (one and several rows, every layout).
"""

from typing import List

import torch

from megatron_ext.blockdiag_cp.layouts import document_starts


def needed_mask(doc_ids: torch.Tensor, starts: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[P] bool: positions whose K/V the given queries need (union over rows).

    ``positions`` ascending: a document's queries are adjacent, and the document
    needs [its start, its last query], one interval per document.
    """
    R, P = doc_ids.shape
    diff = torch.zeros(P + 1, dtype=torch.int32)
    for row in range(R):
        q = positions[doc_ids[row, positions] > 0]
        if q.numel() == 0:
            continue
        s = starts[row, q]
        last = torch.ones_like(q, dtype=torch.bool)
        last[:-1] = s[1:] != s[:-1]
        ones = torch.ones(int(last.sum()), dtype=torch.int32)
        diff.index_add_(0, s[last], ones)
        diff.index_add_(0, q[last] + 1, -ones)
    return diff.cumsum(0)[:P] > 0



def _runs_predecessor_owners(positions: torch.Tensor, owner: torch.Tensor) -> set:
    """Owners of the position just before each contiguous run of ``positions``."""
    pos = positions.tolist()
    preds = set()
    for i, p in enumerate(pos):
        if p > 0 and (i == 0 or pos[i - 1] != p - 1):
            preds.add(int(owner[p - 1]))
    return preds


def reference_build_plan(doc_ids: torch.Tensor, layout, rank: int) -> dict:
    """doc_ids: [R, P] int64 (padded); all tables are global except this rank's indices."""
    R, P = doc_ids.shape
    cp, L = layout.cp, layout.local_len
    owner = layout.owner()
    local_index = layout.local_index()
    starts = document_starts(doc_ids)

    pos_work = torch.where(doc_ids > 0, torch.arange(P) - starts + 1, torch.zeros_like(starts)).sum(0)
    work_per_rank = pos_work[layout.positions].sum(1)

    counts = torch.zeros(cp, cp, dtype=torch.long)
    needed_remote = torch.zeros(cp, dtype=torch.long)
    send_index: List[torch.Tensor] = [torch.empty(0, dtype=torch.long)] * cp
    recv_positions: List[torch.Tensor] = [torch.empty(0, dtype=torch.long)] * cp
    halo_ok, halo_reason = True, "every straddling document comes from the neighbouring shard"
    for dst in range(cp):
        needed = needed_mask(doc_ids, starts, layout.positions[dst])
        remote = torch.nonzero(needed & (owner != dst)).flatten()
        src_of = owner[remote]
        needed_remote[dst] = remote.numel()
        counts[:, dst] = torch.bincount(src_of, minlength=cp)
        if remote.numel():
            preds = _runs_predecessor_owners(layout.positions[dst], owner)
            strays = sorted(set(src_of.unique().tolist()) - preds)
            if strays and halo_ok:
                halo_ok = False
                halo_reason = (f"rank {dst} needs K/V from rank(s) {strays}, which own no shard "
                               f"adjacent to its own (a document straddles more than one boundary)")
        for src in range(cp):
            mine = remote[src_of == src]
            if src == rank:
                send_index[dst] = local_index[mine]
            if dst == rank:
                recv_positions[src] = mine

    exchange = dict(counts=counts, send_index=send_index, recv_positions=recv_positions,
                    halo_ok=halo_ok, halo_reason=halo_reason)

    return dict(rank=rank, cp=cp, rows=R, local_len=L, needed_remote=needed_remote,
                work_per_rank=work_per_rank, exchange=exchange)
