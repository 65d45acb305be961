"""Where each kernel call's output rows go: straight into the result, or into a float32 merge buffer.

A query row that one kernel call attends (a short document's row sees only its own
rank's keys) needs no online softmax: the call's output *is* the row's result, in
the input dtype. A row two calls attend is merged in the result itself: the first
call writes it (out and lse), the second merges into it in place (``merge_rows_``
reads the row, merges in float32 and rounds once: the bits the float32 buffer gives).
Only rows that three or more calls write (a long document's rows, one call per chunk
of earlier keys) are merged by log-sum-exp in float32, in a buffer that holds just
those rows. Forward's out / lse and backward's dq have the same writers, so both
read a ``MergePlan`` per step, kind and window (one per direction: ``ends``):

    query rows of this rank      0 .................................. L*R
    calls writing a row          1 1 1 1 3 3 3 3 1 1 1 1 1 1 2 2 2 1 1
    merged (>= 3): buffer rows           0 1 2 3
    a call covering rows 4..9:   writes rows 8..9 into the result,
                                 merges its rows 4..7 into buffer rows 0..3

Gradients add instead: a row two calls write is the first call's value plus the
second's, added in the result's dtype (one rounding, as through float32).

A merged row's ends skip the buffer where that costs no launch (``ends``): in
forward its first writer writes the result, its second merges the first's output
and its own into the buffer (``opens``), its last merges the buffer and its own into
the result (``closes``); dq's last writer adds the buffer and its own into dq. The
bits are those of copying into the buffer and writing it back, a pass fewer each.
A call that is the last writer of only some of its merged rows closes those and
merges the rest, where then nothing is written back (``_partial_pays``).

A call that covers every row and is the first to write the result lends it its
output tensor (no copy). A first writer that covers fewer rows (the rest padding or
other calls' rows), each of which a later call merges and reads from it alone, keeps
its output instead of copying it into the result (``keeps``): its readers merge from
there (``adds_from``, ``opens_from``; gradients where the rows are runs). The buffer
rows no call closed are written back into the result once, at the end. An attention sink is one more term in every row's
denominator: with one, every row is merged (and nothing skips the buffer).
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .merge_kernel import ATOMIC_DTYPES, add_rows_, copy_rows_, merge_rows_, sum_rows_

# Rows of a buffer a kernel call reads: None (every row, in order), a ``slice`` (one ascending run: a
# view, and merges in place), or an index tensor on the device (a gather, and merges through it).
Rows = Union[None, slice, torch.Tensor]


def device_rows(index: torch.Tensor, rows: int, device) -> Rows:
    """A host index of ``rows`` buffer rows as ``Rows``: None for all of them in order, a slice for one
    ascending run (no gather copy; a varlen call's queries usually are one: a document's local queries
    sit together), else the index on the device."""
    host = index.numpy()  # a host table: read in numpy, no per-element tensor op
    n = host.size
    if n and host[-1] - host[0] + 1 == n and (n == 1 or bool((host[1:] - host[:-1] == 1).all())):
        first = int(host[0])
        return None if (first, n) == (0, rows) else slice(first, first + n)
    return None if rows == n == 0 else index.to(device)  # not a run, so not every row in order either


@dataclass(frozen=True)
class RowSums:
    """Rows of an arrival added into buffer rows that several of them add to (a band group's gradients,
    which every rank that read a key row sends back together), grouped by buffer row (``sum_rows_``):

        arrival row       0  1  2  3  4  5
        its buffer row    7  2  7  9  2  7

        source            1  4  0  2  5  3     grouped by buffer row, ascending within each
        offsets           0     2        5  6
        target            2     7        9
    """

    source: torch.Tensor  # [n] arrival rows, grouped by the buffer row they add to
    offsets: torch.Tensor  # [m + 1] where each group starts in ``source``
    target: torch.Tensor  # [m] each group's buffer row, once each

    @classmethod
    def of(cls, rows: np.ndarray, slots: np.ndarray, device) -> Optional["RowSums"]:
        """Host ``rows`` of an arrival and the buffer ``slots`` they add to: the grouping, or None where no
        slot repeats (one ``add_rows_`` then moves the same bytes)."""
        order = np.lexsort((rows, slots))  # by slot, then row: the order add_rows_ over the rows ascending adds in
        target, first = np.unique(slots[order], return_index=True)
        if target.size == slots.size:
            return None
        offsets = np.append(first, slots.size)

        def on(a):
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)

        return cls(on(rows[order]), on(offsets), on(target))


@dataclass(frozen=True)
class CallMerge:
    """One kernel call's share: rows it writes alone, rows it merges, and where."""

    writes: bool  # some of its rows are, so far, its output alone: those go to the result rows
    merges: bool  # some of its rows are merged in the buffer (buffer to buffer)
    source: Rows  # rows of the call's output that are merged (``Rows`` over the call's rows)
    target: Rows  # their rows in the merge buffer (``Rows`` over ``MergePlan.merged_count``)
    fresh: bool  # no earlier call wrote any of its merged rows: a copy, not a merge
    # (rows of the call's output, their result rows) it writes: only those where it is a pair's second
    # writer (``adds``) or where they are at most half its rows (the merged rest is written by
    # ``Result.finish``: writing it here too would only be overwritten). None: every row it covers.
    alone: Optional[Tuple[Rows, Rows]] = None
    # (rows of its output, result rows) it merges into (gradients: adds to) the result: a pair's second writer
    adds: Optional[Tuple[Rows, Rows]] = None
    # (rows of its output, result rows, buffer rows): merged rows it is the second writer of, whose first
    # writer's output is in the result: merged from there into the buffer (``MergePlan.of``'s ``ends`` "forward")
    opens: Optional[Tuple[Rows, Rows, Rows]] = None
    # (rows of its output, buffer rows, result rows): merged rows it is the last writer of: the buffer's
    # rows and its output merged (gradients: added) straight into the result (``MergePlan.of``'s ``ends``)
    closes: Optional[Tuple[Rows, Rows, Rows]] = None
    # (slot, later calls that read it): a first writer whose every row a later call merges: its output is
    # kept as it is (nothing written) until those calls have read it (``MergePlan.of``'s ``ends``)
    keeps: Optional[Tuple[int, int]] = None
    # where ``adds`` read their first writers' rows (None: from the result): per kept first writer (slot, rows
    # of its output, rows of this call's output, result rows)
    adds_from: Optional[Tuple[Tuple[int, Rows, Rows, Rows], ...]] = None
    # where ``opens`` read its first writer's rows: (slot, rows of that kept output); None: from the result
    opens_from: Optional[Tuple[int, Rows]] = None


# How a row of three or more writers meets the float32 buffer (``MergePlan.of``'s ``ends``):
#   "none"      first writer copies into it, the rest merge (add) there, ``Result.finish`` writes it back;
#   "forward"   the first writes the result, the second merges that and its own into the buffer, the last
#               merges the buffer and its own into the result (no copy into the buffer, no write-back);
#   "gradient"  as "none", but the last adds the buffer and its own into the result where the three are
#               runs (float32 sum, rounded once into the result: the write-back's bits).
ENDS = ("none", "forward", "gradient")


@dataclass(frozen=True)
class MergePlan:
    rows: int  # query rows of the result (local_len * R)
    merged: Rows  # the result's rows held in the buffer, ascending (``Rows`` over ``rows``)
    merged_count: int
    covered: bool  # every row is written by some call or merged (else the rest stay zero)
    uncovered: Rows  # the rows no call writes and none is merged: zeros in the result (None when covered)
    merged_mask: np.ndarray  # [rows] host: merged or not
    needs_zeros: bool  # some merged row is merged into (or read) before a call copies it: the buffer starts at 0
    calls: List[List[CallMerge]]  # per step, per call, as ``stream_on`` orders them
    # (buffer rows, result rows) ``Result.finish`` writes back: the merged rows no call closes (None: none)
    write_back: Optional[Tuple[Rows, Rows]] = None
    # rows a call writes that are zeros in the result: padding the own call attends so that it covers every
    # row (``BlockDiagCPState.run_steps``), zeroed by ``Result.finish`` (None: none)
    padding: Optional[slice] = None

    @classmethod
    def of(cls, steps: Sequence[Sequence], rows: int, device, every_row_merged: bool = False,
           also_merged: Optional[torch.Tensor] = None, ends: str = "none", closing: bool = True,
           padding: Optional[slice] = None, partial: bool = True) -> "MergePlan":
        """``steps``: per step, its calls' host row indices (``CallPlan.q_index``, [Nq] rows each);
        ``also_merged``: host rows merged however many calls write them. A row two calls write is the
        first's output, then the second's merged into it (gradients: added) in the result's dtype, rounded
        once as the float32 buffer gives; only rows of three or more go there. ``ends`` (``ENDS``): how
        their first and last writers meet the buffer; "none" where rows are merged whatever their
        writers (a sink's rescale, returned key gradients) as those read the buffer after every call.
        ``closing`` False: no last writer closes (the plan without them, where they would cost a launch).
        ``partial``: a call that is the last writer of only some of the rows it merges closes those and
        merges the rest in the buffer (one op more), where that leaves no row to write back (else the plan
        without: ``_partial_pays``). ``padding``: rows the calls write that ``Result.finish`` zeroes
        (``MergePlan.padding``)."""
        if ends not in ENDS:
            raise ValueError(f"ends={ends!r}; known: {ENDS}")
        if every_row_merged or also_merged is not None:
            ends = "none"

        def on_device(index: np.ndarray, n: int) -> Rows:
            return device_rows(torch.from_numpy(index), n, device)

        writers = np.zeros(rows, dtype=np.int64)
        nths = []  # per step, per call: which writer of each of its rows it is
        for step in steps:
            here = []
            for q_index in step:
                qi = q_index.numpy()  # a call holds a row at most once
                writers[qi] += 1
                here.append(writers[qi].copy())
            nths.append(here)
        merged = (writers >= 3) | bool(every_row_merged)
        if also_merged is not None:
            merged[also_merged.numpy()] = True
        paired = (writers == 2) & ~merged  # the second writer merges (adds) into the result
        slot = np.cumsum(merged) - 1  # a merged row's place in the buffer
        count = int(merged.sum())
        opened = _opened(steps, nths, merged) if ends == "forward" else np.zeros(rows, dtype=bool)
        keeps, reads, first_writer = (_kept(steps, nths, paired, opened, rows, runs=ends == "gradient")
                                      if ends != "none" else ({}, {}, None))
        cid = -1  # the call's place in the step order (``_kept``'s keys)
        split = 0  # calls that close some of their merged rows and merge the rest (``partial``)
        seen = np.zeros(rows, dtype=bool)  # merged rows some call wrote into the buffer
        written = np.zeros(rows, dtype=bool)  # paired rows their first writer wrote
        closed = np.zeros(rows, dtype=bool)  # merged rows their last writer merged into the result
        needs_zeros = False
        calls: List[List[CallMerge]] = []
        for step, step_nths in zip(steps, nths):
            here = []
            for q_index, nth in zip(step, step_nths):
                cid += 1
                qi = q_index.numpy()
                mine = merged[qi]
                first = mine & (nth == 1) & opened[qi]
                second = paired[qi] & written[qi]
                written[qi[paired[qi]]] = True
                if cid in keeps:  # every row's first writer, each merged by one later call: nothing written now
                    here.append(CallMerge(False, False, None, None, False, keeps=keeps[cid]))
                    continue
                own = np.flatnonzero((~mine & ~second) | first)  # the rows this call's output is the result of, so far
                opening = np.flatnonzero(mine & (nth == 2) & opened[qi])
                opens = closes = None
                opens_from = adds_from = None
                if opening.size:
                    opens = (on_device(opening, qi.size), on_device(qi[opening], rows),
                             on_device(slot[qi[opening]], count))
                    seen[qi[opening]] = True
                    if cid in reads:  # forward: one kept first writer (``_kept``)
                        (kept_slot, kept_at, kept_rows, _), = reads[cid]
                        opens_from = (kept_slot, on_device(kept_at[qi[opening]], kept_rows))
                at = np.flatnonzero(mine & ~(opened[qi] & (nth <= 2)))  # merged in the buffer
                # The last writer of every row it merges there: into the result instead (one op either way;
                # "gradient": where the buffer's, its own and the result's rows are runs)
                # (``partial``: of the rows it is the last writer of, the rest merged in the buffer: one op more)
                ending = (nth[at] == writers[qi[at]]) if closing and ends != "none" and at.size else None
                if ending is not None and (bool(ending.all()) or (partial and bool(ending.any()))):
                    lasts = at[ending]
                    last = (on_device(lasts, qi.size), on_device(slot[qi[lasts]], count), on_device(qi[lasts], rows))
                    if ends == "forward" or not any(isinstance(r, torch.Tensor) for r in last):
                        closed[qi[lasts]] = True
                        closes, at = last, at[~ending]
                        split += int(at.size > 0)
                late = np.flatnonzero(second)
                alone = None
                # Writing every row would overwrite a first writer's half of a pair (or the first writer's
                # output a second merges from: ``opens``); merged rows are only overwritten later, so those
                # are skipped when that saves bytes
                if own.size and (late.size or opening.size or ((mine & ~first).any() and 2 * own.size <= qi.size)):
                    alone = (on_device(own, qi.size), on_device(qi[own], rows))
                adds = (on_device(late, qi.size), on_device(qi[late], rows)) if late.size else None
                if late.size and cid in reads:  # per kept first writer: its rows there, ours, the result's
                    adds_from = tuple(
                        (kept_slot, on_device(kept_at[qi[mine_]], kept_rows), on_device(mine_, qi.size),
                         on_device(qi[mine_], rows))
                        for kept_slot, kept_at, kept_rows, kept_cid in reads[cid]
                        for mine_ in [late[first_writer[qi[late]] == kept_cid]] if mine_.size)
                if at.size:
                    fresh = not bool(seen[qi[at]].any())
                    needs_zeros |= not fresh and not bool(seen[qi[at]].all())
                    seen[qi[at]] = True
                    here.append(CallMerge(bool(own.size), True, on_device(at, qi.size),
                                          on_device(slot[qi[at]], count), fresh, alone, adds, opens, closes,
                                          adds_from=adds_from, opens_from=opens_from))
                else:
                    here.append(CallMerge(bool(own.size), False, None, None, False, alone, adds, opens, closes,
                                          adds_from=adds_from, opens_from=opens_from))
            calls.append(here)
        target = on_device(np.flatnonzero(merged), rows) if count else None
        needs_zeros |= not bool(seen[merged].all())  # a merged row no call writes (a ring piece's padding)
        back = np.flatnonzero(merged & ~closed)  # the merged rows ``finish`` writes back
        if split and not _partial_pays(split, back.size, ends, scattered=isinstance(target, torch.Tensor)):
            return cls.of(steps, rows, device, every_row_merged, also_merged, ends, closing, padding, partial=False)
        write_back = None
        if back.size == count and count:
            write_back = (None, target)
        elif back.size:
            write_back = (on_device(slot[back], count), on_device(back, rows))
            if isinstance(write_back[0], torch.Tensor) or (isinstance(write_back[1], torch.Tensor)
                                                           and not isinstance(target, torch.Tensor)):
                # the rows left to write back are scattered where all of them were not: a gather (and a
                # scatter) each, more launches than the closes save
                return cls.of(steps, rows, device, every_row_merged, also_merged, ends, closing=False,
                              padding=padding, partial=False)
        empty = np.flatnonzero((writers == 0) & ~merged)  # never written: a padding row's zeros
        uncovered = on_device(empty, rows) if empty.size else None
        return cls(rows, target, count, not empty.size, uncovered, merged, needs_zeros, calls, write_back, padding)


def _partial_pays(split: int, left: int, ends: str, scattered: bool) -> bool:
    """Whether ``split`` calls that each close some rows and merge the rest (an op more each) pay: only
    where no merged row is left to write back (``left``), and the ops the write-back took are at least
    those added (out: a cast, and a scatter where the merged rows are ``scattered``; forward's lse: one
    more). Each closed row is then written once, in the result's dtype, instead of into the buffer and
    again through the cast."""
    write_back_ops = 1 + int(scattered) + int(ends == "forward")
    return left == 0 and split <= write_back_ops


def _kept(steps, nths, paired: np.ndarray, opened: np.ndarray, rows: int, runs: bool):
    """The first writers whose output is kept rather than written: ({call: (slot, reads)}, {reader call:
    [(slot, [rows] a row's place in that kept output, the kept output's rows, the kept call)]}, [rows] the
    call that writes each row first (-1: none)), calls numbered in step order.

    ``paired`` / ``opened``: [rows] the rows a later call merges from their first writer's output (a
    pair's second, ``adds``; a row "forward" opens, ``opens``). A call is kept when every row it covers is
    one of those and it is their first writer, and each call that merges them reads only from it, or
    (gradients) covers every row: that reader lends the result its output and adds each kept first
    writer's rows there, one op each as in place. Writing them first would be a pass over rows the
    second reads once. Not a call that covers every row in order: it lends the result its output,
    nothing copied. ``runs`` (gradients): a reader of one kept call, where it does not cover every row,
    only where the kept rows, its own and the result's are runs (one ``torch.add`` into the result)."""
    calls = [(q_index.numpy(), nth) for step, step_nths in zip(steps, nths) for q_index, nth in zip(step, step_nths)]
    first = np.full(rows, -1, dtype=np.int64)
    second = np.full(rows, -1, dtype=np.int64)
    for cid, (qi, nth) in enumerate(calls):
        first[qi[nth == 1]] = cid
        second[qi[nth == 2]] = cid
    later = paired | opened
    kept = {cid for cid, (qi, nth) in enumerate(calls)
            if qi.size and later[qi].all() and (nth == 1).all() and not (qi.size == rows and _is_run(qi))}
    place = {}  # a kept candidate's [rows]: each row's place in its output
    for cid in kept:
        qi = calls[cid][0]
        place[cid] = np.full(rows, -1, dtype=np.int64)
        place[cid][qi] = np.arange(qi.size)
    changed = True
    while changed:  # drop the calls whose readers read from anything but them (or, lending, kept calls)
        changed = False
        for cid in sorted(kept):
            qi, at = calls[cid][0], place[cid]
            for reader in np.unique(second[qi]).tolist():
                rq, rn = calls[reader]
                read = rq[later[rq] & (rn == 2)]
                lends = runs and rq.size == rows and _is_run(rq) and not opened[read].any()
                if lends:
                    fine = all(w in kept for w in np.unique(first[read]).tolist())
                else:
                    fine = bool((first[read] == cid).all()) and (not runs or (
                        _is_run(at[read]) and _is_run(read) and _is_run(np.flatnonzero(later[rq] & (rn == 2)))))
                if not fine:
                    kept.discard(cid)
                    changed = True
                    break
    keeps, reads = {}, {}
    for cid in sorted(kept):
        qi = calls[cid][0]
        uses = 0
        for reader in np.unique(second[qi]).tolist():
            rq, rn = calls[reader]
            read = rq[later[rq] & (rn == 2) & (first[rq] == cid)]
            uses += int(paired[read].any()) + int(opened[read].any())  # its adds and its opens read it
            reads.setdefault(reader, []).append((len(keeps), place[cid], qi.size, cid))
        keeps[cid] = (len(keeps), uses)
    return keeps, reads, first


def copied_rows(plan: MergePlan, steps) -> int:
    """Rows ``plan``'s calls (``steps``: per step, per call, its query rows, as ``plan`` was built from) copy
    into the result as they are: every row a call writes, but where the first call to write covers every
    row (it lends the result its output) or keeps its output (``CallMerge.keeps``). The part of a plan's
    cost its call order moves: a pair's add, a merge and a write-back are the same in any order."""
    copied, written = 0, False
    for calls, shares in zip(steps, plan.calls):
        for q_index, share in zip(calls, shares):
            if not share.writes:
                continue
            n = q_index.numel()
            if written or n != plan.rows or not _is_run(q_index.numpy()):  # else: lent, as ``Result.write``
                picked = None if share.alone is None else share.alone[0]
                copied += (picked.numel() if isinstance(picked, torch.Tensor)
                           else len(range(n)[_all(picked)]))
            written = True
    return copied


def _is_run(index: np.ndarray) -> bool:
    """One ascending run of consecutive rows (or none)."""
    return index.size < 2 or bool((np.diff(index) == 1).all())


def _opened(steps, nths, merged: np.ndarray) -> np.ndarray:
    """[rows] the merged rows "forward" opens: the first writer writes them to the result, the second
    merges from there into the buffer. Only where that replaces a buffer op rather than adding one: every
    merged row of the first's call is one it opens first, and every merged row of the second's call is one
    it opens first or second, and the second's call does not write rows of its own over every row (its
    output would otherwise become the result, uncopied). Starts from every merged row and drops rows until
    these hold."""
    rows = merged.size
    opened = merged.copy()
    changed = True
    while changed:
        changed = False
        for step, step_nths in zip(steps, nths):
            for q_index, nth in zip(step, step_nths):
                qi = q_index.numpy()
                mine = merged[qi]
                firsts, seconds = qi[mine & (nth == 1)], qi[mine & (nth == 2)]
                if firsts.size and not (bool(opened[firsts].all()) and not (mine & (nth >= 2)).any()):
                    changed |= bool(opened[firsts].any())
                    opened[firsts] = False
                if seconds.size and not (bool(opened[seconds].all()) and bool(opened[firsts].all())
                                         and not (mine & (nth >= 3)).any() and (qi.size < rows or mine.all())):
                    changed |= bool(opened[seconds].any())
                    opened[seconds] = False
    return opened


class Accumulator:
    """Online softmax over kernel calls on the merge buffer's rows: out and lse in float32."""

    def __init__(self, rows: int, heads: int, dv: int, dtype, device, zeros: bool = True):
        # zeros=False: every row's first call copies it (``MergePlan.needs_zeros``), so nothing is read unset
        self.out = (torch.zeros if zeros else torch.empty)(rows, heads, dv, dtype=dtype, device=device)
        self.lse = (torch.full((rows, heads), float("-inf"), dtype=dtype, device=device) if zeros
                    else torch.empty(rows, heads, dtype=dtype, device=device))

    def merge(self, index: Rows, out: torch.Tensor, lse: torch.Tensor, fresh: bool, source: Rows = None) -> None:
        """Merge rows ``source`` of one call's [n, H, Dv] out and [n, H] lse into buffer rows ``index``:
        one ``merge_rows_`` (views for runs, its index arguments for scattered rows)."""
        if fresh:  # nothing merged into these rows yet: a copy (into a run, cast on the way)
            set_rows(self.out, index, out, source)
            set_rows(self.lse, index, lse, source)
            return
        merge_into(self.out, self.lse, index, out, lse, source)

    def open(self, opens: Tuple[Rows, Rows, Rows], result: "Result", out: torch.Tensor, lse: torch.Tensor,
             kept: Optional[Tuple[int, Rows]] = None) -> None:
        """Rows a second writer merges (``CallMerge.opens``): the first's output and lse, in the result (or
        kept: ``CallMerge.opens_from``), merged with this call's into the buffer (nothing copied into it first)."""
        source, rows, slots = opens
        first, first_lse, rows = result.first_output(kept, rows)
        merge_into(first, first_lse, rows, out, lse, source, self.out, self.lse, slots)

    def close(self, closes: Tuple[Rows, Rows, Rows], result: "Result", out: torch.Tensor, lse: torch.Tensor) -> None:
        """Rows a last writer merges (``CallMerge.closes``): the buffer's and this call's, into the result
        (rounded once there: nothing written back after)."""
        source, slots, rows = closes
        merge_into(self.out, self.lse, slots, out, lse, source, result.allocated(), result.lse, rows)


def merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, index: Rows, out: torch.Tensor,
               lse: torch.Tensor, source: Rows = None, dst_out: Optional[torch.Tensor] = None,
               dst_lse: Optional[torch.Tensor] = None, dst_index: Rows = None) -> None:
    """``acc_out`` / ``acc_lse``'s rows ``index`` merged with ``out`` / ``lse``'s rows ``source`` (into
    ``dst_out`` / ``dst_lse``'s rows ``dst_index`` where given): one ``merge_rows_`` (views for runs, its
    index arguments for scattered rows)."""
    acc_out, acc_lse, target = _op_rows(acc_out, acc_lse, index)
    out, lse, rows = _op_rows(out, lse, source)
    dst_target = None
    if dst_out is not None:
        dst_out, dst_lse, dst_target = _op_rows(dst_out, dst_lse, dst_index)
    merge_rows_(acc_out, acc_lse, out, lse, rows, target, dst_out, dst_lse, dst_target)


def _op_rows(a: torch.Tensor, b: torch.Tensor, rows: Rows):
    """(a, b, index) as ``merge_rows_`` takes rows ``rows`` of them: the tensors and the index tensor for
    scattered rows, their views and None for a run (or every row)."""
    if isinstance(rows, torch.Tensor):
        return a, b, rows
    return gather(a, rows), gather(b, rows), None


class Result:
    """A result tensor [rows, H, D] (and optionally lse [rows, H]) that calls write row ranges of."""

    def __init__(self, plan: MergePlan, heads: int, dim: int, dtype, lse_dtype, device, with_lse: bool):
        self.plan, self.shape = plan, (plan.rows, heads, dim)
        self.dtype, self.lse_dtype, self.device, self.with_lse = dtype, lse_dtype, device, with_lse
        self.value: Optional[torch.Tensor] = None
        self.lse: Optional[torch.Tensor] = None
        self.kept = {}  # slot -> [output, lse, readers left]: first writers' outputs (``CallMerge.keeps``)

    def _allocate(self) -> None:
        self.value = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        if not self.plan.covered:  # only the rows nothing writes start at zero
            _zero_rows(self.value, self.plan.uncovered)
        if self.with_lse:
            self.lse = torch.full(self.shape[:2], float("-inf"), dtype=self.lse_dtype, device=self.device)

    def allocated(self) -> torch.Tensor:
        """The result tensor, allocated if no call wrote it yet (the rows nothing writes at zero)."""
        if self.value is None:
            self._allocate()
        return self.value

    def write(self, index: Rows, value: torch.Tensor, lse: Optional[torch.Tensor] = None,
              alone: Optional[Tuple[Rows, Rows]] = None) -> bool:
        """The result's rows ``index`` are ``value``; with ``alone`` (``CallMerge.alone``) only the rows the
        call writes alone (the merged ones are ``finish``'s). True where ``value`` became the result."""
        if self.value is None and index is None:  # the first writer covers every row: its tensor is the result
            self.value = value.to(self.dtype).contiguous()
            self.lse = None if lse is None else lse.to(self.lse_dtype).contiguous()
            return True
        self.allocated()
        source = None
        if alone is not None:
            source, index = alone
        set_rows(self.value, index, value, source)
        if lse is not None:
            set_rows(self.lse, index, lse, source)
        return False

    def keep(self, keeps: Tuple[int, int], value: torch.Tensor, lse: Optional[torch.Tensor] = None) -> None:
        """A first writer's output, kept as it is for the later calls that merge its rows (``CallMerge.keeps``;
        in the result's dtypes: the bits writing it would have given)."""
        slot, readers = keeps
        self.kept[slot] = [value.to(self.dtype), None if lse is None else lse.to(self.lse_dtype), readers]

    def first_output(self, kept: Optional[Tuple[int, Rows]], rows: Rows):
        """(output, lse, rows) a second writer reads its first writer's rows ``rows`` of the result from: the
        result, or the first writer's kept output (``kept``: (slot, its rows), from ``CallMerge.adds_from`` /
        ``opens_from``), let go after its last reader."""
        if kept is None:
            return self.allocated(), self.lse, rows
        slot, at = kept[:2]
        entry = self.kept[slot]
        entry[2] -= 1
        if not entry[2]:
            del self.kept[slot]
        return entry[0], entry[1], at

    def merge(self, adds: Tuple[Rows, Rows], value: torch.Tensor, lse: torch.Tensor, kept=None) -> None:
        """A pair's second writer in forward: its rows ``adds[0]`` merged with the first writer's (in the
        result, or kept: ``CallMerge.adds_from``) into the result's rows ``adds[1]``, in float32, rounded once."""
        source, index = adds
        if kept is None:
            merge_into(self.value, self.lse, index, value, lse, source)
            return
        for entry in kept:  # forward keeps one first writer per reader (``_kept``)
            first, first_lse, rows = self.first_output(entry, None)
            merge_into(first, first_lse, rows, value, lse, entry[2], self.allocated(), self.lse, entry[3])

    def add(self, adds: Tuple[Rows, Rows], value: torch.Tensor, kept: Optional[Tuple[int, Rows]] = None,
            lent: bool = False) -> None:
        """A pair's second writer: the result's rows ``adds[1]`` are the first writer's value (in the result,
        or kept: ``CallMerge.adds_from``) plus ``value``'s rows ``adds[0]``, in the result's dtype, rounded
        once (either order: the same bits). ``lent``: ``value`` is the result (``write``)."""
        source, index = adds
        if kept is None:
            add_rows(self.value, index, value, source)
            return
        for entry in kept:  # per kept first writer: (slot, its rows, ours, the result's)
            first, _, rows = self.first_output(entry, None)
            source, index = entry[2], entry[3]
            if lent:  # this call's rows are there already: the first writer's added onto them
                add_rows(self.value, index, first, rows)
            elif not any(isinstance(r, torch.Tensor) for r in (index, rows, source)):
                torch.add(gather(first, rows), gather(value, source), out=gather(self.allocated(), index))
            else:  # not planned (``_kept``), but right whatever wrote the result first
                set_rows(self.allocated(), index, torch.add(gather(first, rows), gather(value, source)))

    def take_output(self, index: Rows, share: CallMerge, out: torch.Tensor, lse: torch.Tensor,
                    acc: Accumulator) -> None:
        """One forward call's out / lse over its rows ``index`` (a ``MergePlan`` share): the rows it writes
        alone into the result, a pair's second merged there, the merged rows through ``acc``."""
        if share.keeps is not None:
            self.keep(share.keeps, out, lse)
            return
        if share.adds_from is not None or share.opens_from is not None:
            self.allocated()  # not lent: the merge reads this call's output while it writes the result
        if share.writes:
            self.write(index, out, lse, alone=share.alone)
        if share.adds is not None:  # rows a first call wrote (or kept): merged into the result
            self.merge(share.adds, out, lse, share.adds_from)
        if share.opens is not None:  # the first writer's output is in the result (or kept)
            acc.open(share.opens, self, out, lse, share.opens_from)
        if share.merges:
            acc.merge(share.target, out, lse, share.fresh, share.source)
        if share.closes is not None:  # the last writer: straight into the result
            acc.close(share.closes, self, out, lse)

    def take(self, index: Rows, share: CallMerge, grad: torch.Tensor, buffer: torch.Tensor) -> None:
        """One call's gradient over its rows ``index`` (a ``MergePlan`` share): the rows it
        writes alone into the result, a pair's second added there, the merged rows into ``buffer``."""
        if share.keeps is not None:
            self.keep(share.keeps, grad)
            return
        lent = self.write(index, grad, alone=share.alone) if share.writes else False
        if share.adds is not None:
            self.add(share.adds, grad, share.adds_from, lent)
        if share.merges:
            (set_rows if share.fresh else add_rows)(buffer, share.target, grad, share.source)
        if share.closes is not None:  # runs (``ends`` "gradient"): summed in float32, rounded once
            source, slots, rows = share.closes
            torch.add(gather(buffer, slots), gather(grad, source), out=gather(self.allocated(), rows))

    def finish(self, merged_value: Optional[torch.Tensor], merged_lse: Optional[torch.Tensor] = None):
        """Write back the merge buffer's rows no call closed; (value, lse) of every row."""
        self.allocated()
        self.kept.clear()  # outputs a failed call left unread
        if merged_value is not None and self.plan.write_back is not None:
            slots, rows = self.plan.write_back
            set_rows(self.value, rows, merged_value, slots)
            if merged_lse is not None:
                set_rows(self.lse, rows, merged_lse, slots)
        if self.plan.padding is not None:  # the lse keeps the padding's own: backward attends it alike
            self.value[self.plan.padding].zero_()
        return self.value, self.lse


class KeyGradients:
    """dK and dV of this rank's own keys ([rows, H, Dk] and [rows, H, Dv]).

    A key row that one local kernel call attends alone takes that call's gradient, in the input
    dtype, and one two writers give (two local calls, or one and a gradient coming back: ``add``)
    their sum, added in place; the rows of three or more writers, or every row that went to other
    ranks (the ring, hierarchical, several rows of doc ids), add up in a float32 buffer [merged rows, H,
    Dk + Dv], written back by ``finish``; ``returns`` (``step_tables.KeyReturns``, None for the ring and
    several rows of doc ids) says where each returned gradient's rows go. ``plan``: a ``MergePlan`` over
    the key rows (the own calls), the returned rows among its merged ones.
    """

    def __init__(self, plan: MergePlan, heads: int, dk: int, dv: int, dtype, acc_dtype, device, slot, rows: int = 1,
                 returns=None):
        self.plan, self.dk_dim, self.R = plan, dk, rows
        self.dk = Result(plan, heads, dk, dtype, acc_dtype, device, with_lse=False)
        self.dv = Result(plan, heads, dv, dtype, acc_dtype, device, with_lse=False)
        self._buffer_shape, self._acc_dtype, self._device = (plan.merged_count, heads, dk + dv), acc_dtype, device
        self._buffer: Optional[torch.Tensor] = None
        self.slot = slot  # [positions] a row's place in the buffer (-1: not merged); None: every row, in order
        self.returns = returns  # step.KeyReturns: per step, returned rows added in place or merged; None: merged

    @property
    def buffer(self) -> torch.Tensor:
        """The float32 buffer, made at its first use: after the first call's kernel let go of its
        workspace, not beside it."""
        if self._buffer is None:
            self._buffer = (torch.zeros if self.plan.needs_zeros else torch.empty)(
                self._buffer_shape, dtype=self._acc_dtype, device=self._device)
        return self._buffer

    def take(self, index: Rows, share: CallMerge, gk: torch.Tensor, gv: torch.Tensor) -> None:
        """One local call's key gradients over its key rows ``index``."""
        self.dk.take(index, share, gk, self.buffer[..., :self.dk_dim])
        self.dv.take(index, share, gv, self.buffer[..., self.dk_dim:])

    def add(self, rows: Rows, grad: torch.Tensor, step=None) -> None:
        """Gradients of our rows ``rows`` (local positions) coming back at ``step``: [n, b, F] (F = Hkv *
        (Dk + Dv)), or planar [2, n, b, F / 2] (dK rows, then dV's; Dk = Dv); a position is R rows of doc
        ids (every row is merged then)."""
        planar = grad.dim() == 4
        _, heads, width = self._buffer_shape  # not the buffer's own shape: that would make it here
        if self.returns is not None:  # every step a gradient comes back at has its entry
            added, merged = self.returns.steps[step]
            if planar:
                grad = grad.reshape(2, grad.shape[1], heads, self.dk_dim)
            else:
                grad = grad.reshape(grad.shape[0], heads, width)
            if added is not None:  # rows of at most two writers: added into dK / dV, in their dtype
                source, index = added
                part = _gather_rows(grad, source, planar)
                add_rows(self.dk.allocated(), index, part[0] if planar else part[..., :self.dk_dim])
                add_rows(self.dv.allocated(), index, part[1] if planar else part[..., self.dk_dim:])
            if merged is not None:
                source, index = merged
                self._into_buffer(index, grad, source, planar)
            return
        R = self.R
        if planar:
            grad = grad.reshape(2, grad.shape[1] * R, heads, self.dk_dim)
        else:
            grad = grad.reshape(grad.shape[0] * R, heads, width)
        if self.slot is None:
            if R > 1 and isinstance(rows, slice):
                rows = slice(rows.start * R, rows.stop * R)
            elif R > 1 and isinstance(rows, torch.Tensor):
                rows = (rows.unsqueeze(1) * R + torch.arange(R, device=rows.device)).reshape(-1)
            self._into_buffer(rows, grad, None, planar)
        else:  # every returned row is merged: its place in the buffer, looked up on the device
            index = self.slot.index_select(0, rows) if isinstance(rows, torch.Tensor) else self.slot[_all(rows)]
            self._into_buffer(index, grad, None, planar)

    def _into_buffer(self, index: Union[Rows, RowSums], grad: torch.Tensor, source: Rows, planar: bool) -> None:
        """buffer[index] += grad[source]: one op fused, one a half planar; ``RowSums``: each buffer row
        several rows of ``grad`` add to, summed first (``sum_rows_``)."""
        halves = ((self.buffer, grad),) if not planar else (
            (self.buffer[..., :self.dk_dim], grad[0]), (self.buffer[..., self.dk_dim:], grad[1]))
        for dst, src in halves:
            if isinstance(index, RowSums):
                sum_rows_(dst, src, index.source, index.offsets, index.target)
            else:
                add_rows(dst, index, src, source)

    def finish(self):
        """(dk, dv) of every row."""
        dk, _ = self.dk.finish(self.buffer[..., :self.dk_dim])
        dv, _ = self.dv.finish(self.buffer[..., self.dk_dim:])
        return dk, dv


def add_rows(dst: torch.Tensor, index: Rows, src: torch.Tensor, source: Rows = None) -> None:
    """dst[index] += src[source] for ``Rows``: in place on runs; one ``add_rows_`` where either side is
    scattered and dst is a float32 buffer (the rows read where they lie, cast on the way), else
    index_add_ (after a gather for scattered ``source``)."""
    if not isinstance(index, torch.Tensor) and not isinstance(source, torch.Tensor):
        dst[_all(index)].add_(src[_all(source)])
    elif dst.dtype in ATOMIC_DTYPES:
        _rows_into(dst, index, src, source, accumulate=True)
    elif isinstance(index, torch.Tensor):
        dst.index_add_(0, index, gather(src, source).to(dst.dtype))
    else:
        dst[_all(index)].add_(gather(src, source))


def set_rows(dst: torch.Tensor, index: Rows, src: torch.Tensor, source: Rows = None) -> None:
    """dst[index] = src[source] for ``Rows``: a copy between runs, else one ``copy_rows_`` (the rows read
    where they lie, cast on the way)."""
    if not isinstance(index, torch.Tensor) and not isinstance(source, torch.Tensor):
        dst[_all(index)].copy_(src[_all(source)])
    else:
        _rows_into(dst, index, src, source, accumulate=False)


def _rows_into(dst: torch.Tensor, index: Rows, src: torch.Tensor, source: Rows, accumulate: bool) -> None:
    """``add_rows_`` / ``copy_rows_`` (``accumulate``) over ``Rows``: a run is a view (no index), a
    [rows, H] tensor a [rows, H, 1] one."""
    dst, target = (dst, index) if isinstance(index, torch.Tensor) else (dst[_all(index)], None)
    src, source = (src, source) if isinstance(source, torch.Tensor) else (src[_all(source)], None)
    if dst.dim() == 2:
        dst, src = dst.unsqueeze(-1), src.unsqueeze(-1)
    (add_rows_ if accumulate else copy_rows_)(dst, src, source, target)


def _zero_rows(dst: torch.Tensor, index: Rows) -> None:
    if isinstance(index, torch.Tensor):
        dst.index_fill_(0, index, 0)
    else:
        dst[_all(index)].zero_()


def _all(index) -> slice:
    """A ``Rows`` that is not an index tensor, as a slice (None: every row)."""
    return slice(None) if index is None else index


def rows_of(rows: Rows, index: Rows) -> Rows:
    """``rows[index]`` for two ``Rows`` (slices as ``device_rows`` makes them: a start and a stop): a run of a
    run is a run, a run of an index tensor a view of it, an index into an index a gather."""
    if rows is None:
        return index
    if index is None:
        return rows
    if isinstance(rows, slice):
        return slice(rows.start + index.start, rows.start + index.stop) if isinstance(index, slice) else index + rows.start
    return rows[index] if isinstance(index, slice) else rows.index_select(0, index)


def _gather_rows(x: torch.Tensor, index, planar: bool) -> torch.Tensor:
    """``gather`` of rows, along dim 1 of a planar [2, n, ...] tensor (both halves in one op)."""
    if not planar:
        return gather(x, index)
    return x.index_select(1, index) if isinstance(index, torch.Tensor) else x[:, _all(index)]


def gather(x: torch.Tensor, index) -> torch.Tensor:
    """The rows ``index`` (``Rows``) of ``x``: a view for None or a run, a copy for an index."""
    return x.index_select(0, index) if isinstance(index, torch.Tensor) else x[_all(index)]


__all__ = ["Accumulator", "CallMerge", "KeyGradients", "MergePlan", "Result", "RowSums", "add_rows", "copied_rows",
           "gather", "merge_into", "rows_of", "set_rows"]
