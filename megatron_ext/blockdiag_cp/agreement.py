"""Cross-rank agreement: the few small all-reduces that keep every CP rank on the same path.

A rank that takes a different branch from its peers (another collective, another
size, an error the others never see) hangs the group until the process-group
timeout. So every decision that depends on rank-local facts is taken from a
reduced vector that every rank holds identically:

- once per step, ``BlockDiagCPState.build`` reduces the input verdict, the
  document-id fingerprint, the sequence shape, the requested knobs, the kernels
  each rank can run, and the kernel failures not yet raised;
- once per attention forward call (CP > 1), the q/k/v shape and dtype signature
  with the softmax scale and dropout, so a rank whose tensors or arguments are
  off raises together with the others instead of leaving them waiting in the
  K/V exchange;
- at the end of a ``blockdiag_cp_step``, the kernel failures of that step.

Each fact x rides as the pair (x, ~x) in one int64 MAX all-reduce: the maximum of
~x is ~min(x), so every rank learns max and min (and so whether all ranks agree)
from a single collective.

Every agreement is the same vector: ``AGREEMENT_WORDS`` int64, whatever its kind.
Its header says which agreement point this rank is at (``KINDS``) and whether it
joins as invalid (``INVALID_REASONS``: its step raised, it has no step state, its
attention arguments are bad). Two ranks that meet at different points (one
leaving a failed step, its peer agreeing on q/k/v) so still exchange one message
size, and both raise the same ``BlockDiagCPError`` from the header instead of
the collective aborting on a size mismatch or one rank waiting alone.

Kernel failures a rank records outside any step context (a pipeline schedule's
backward, an explicit ``state=``) wait in this process's pending list until the
next agreement point raises them on every rank.
"""

import threading
from typing import Dict, Iterable, List, Tuple

import numpy as np
import torch
import torch.distributed as dist


class BlockDiagCPError(RuntimeError):
    """The engine's error; nearly always raised identically on every CP rank (``on_every_rank``)."""

    # True when every CP rank raises this error at the same point (an agreement's outcome), so a step
    # that exits with it has nothing left to tell its peers. False for a refusal the rank takes alone
    # before any collective (a second thread, a nested step): its step's exit tells the peers.
    on_every_rank = False


def raised_on_every_rank(error: BlockDiagCPError) -> BlockDiagCPError:
    """Mark ``error`` as raised by every CP rank at the same point (see ``on_every_rank``)."""
    error.on_every_rank = True
    return error


# Agreement points, the header's kind (any order; the names appear in the errors).
KIND_BUILD, KIND_QKV, KIND_STEP_END = 1, 2, 3
KINDS = {KIND_BUILD: "building a step state (BlockDiagCPState.build)",
         KIND_QKV: "the q/k/v agreement of an attention call",
         KIND_STEP_END: "the end of a blockdiag_cp_step"}

# Why a rank joins an agreement as invalid; the lowest invalid rank's reason is named on every rank.
INVALID_STEP_RAISED, INVALID_NO_STATE, INVALID_ARGUMENTS = 1, 2, 3
INVALID_REASONS = {INVALID_STEP_RAISED: "left its blockdiag_cp_step with an exception",
                   INVALID_NO_STATE: "ran block-diagonal CP attention with CP > 1 but no step state",
                   INVALID_ARGUMENTS: "passed invalid attention arguments (q/k/v, window_size or softmax_offset)"}

# Facts an agreement may carry besides its header; unused slots ride as zeros.
FACT_SLOTS = 32
_HEADER = ("_kind", "_invalid_at")
AGREEMENT_WORDS = 2 * (len(_HEADER) + FACT_SLOTS)
# _invalid_at of a valid rank (above every rank * _REASON_BASE + reason); the MIN names the lowest invalid rank.
_VALID = 1 << 62
_REASON_BASE = 16


class AgreedFacts:
    """The reduced view of one agreement: max, min and whether all ranks agreed, per fact."""

    def __init__(self, names: List[str], reduced: List[int]):
        self._index = {name: i for i, name in enumerate(names)}
        self._reduced = reduced

    def max(self, name: str) -> int:
        return self._reduced[2 * self._index[name]]

    def min(self, name: str) -> int:
        return ~self._reduced[2 * self._index[name] + 1]

    def agreed(self, name: str) -> bool:
        return self.max(name) == self.min(name)

    def disagreeing(self, names: Iterable[str]) -> List[str]:
        return [name for name in names if not self.agreed(name)]


def agree(facts: Dict[str, int], group, cp: int, device=None, *, kind: int, invalid: int = 0,
          detail: str = "") -> AgreedFacts:
    """One int64 MAX all-reduce of (x, ~x) for every fact; a plain copy when cp == 1.

    ``kind``: the agreement point (``KINDS``). ``invalid``: 0, or why this rank cannot go
    on (``INVALID_REASONS``), with ``detail`` its own account of the value. When any rank
    joins invalid, or the ranks are at different points, every rank raises the same
    ``BlockDiagCPError`` here. NCCL reduces on ``device`` (the caller's tensors' device;
    default the current CUDA device); other backends on the CPU.
    """
    names = list(facts)
    if len(names) > FACT_SLOTS:
        raise ValueError(f"an agreement carries at most {FACT_SLOTS} facts, got {len(names)}: raise FACT_SLOTS")
    rank = dist.get_rank(group) if cp > 1 else 0
    header = [kind, rank * _REASON_BASE + invalid if invalid else _VALID]
    local = []
    for value in header + [int(facts[name]) for name in names] + [0] * (FACT_SLOTS - len(names)):
        local += [value, ~value]
    if cp > 1:
        vec = torch.tensor(local, dtype=torch.int64)  # [AGREEMENT_WORDS], the same on every kind
        if dist.get_backend(group) == "nccl":
            vec = vec.to(device) if device is not None and torch.device(device).type == "cuda" else vec.cuda()
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
        local = vec.cpu().tolist()
    reduced = AgreedFacts(list(_HEADER) + names, local)
    first_invalid = reduced.min("_invalid_at")
    if first_invalid != _VALID:
        raise raised_on_every_rank(_invalid_error(first_invalid // _REASON_BASE, first_invalid % _REASON_BASE,
                                                  rank, invalid, detail, kind))
    if not reduced.agreed("_kind"):
        raise raised_on_every_rank(BlockDiagCPError(
            f"the CP ranks reached different agreement points ({KINDS.get(reduced.min('_kind'), '?')} on some, "
            f"{KINDS.get(reduced.max('_kind'), '?')} on others; this rank: {KINDS[kind]}): their programs "
            "diverged (a rank skipped or repeated a step, a build or an attention call, e.g. after catching "
            "an error its peers did not catch); every CP rank must run the same steps and layers"))
    return reduced


def _invalid_error(first: int, reason: int, rank: int, my_reason: int, detail: str, kind: int) -> BlockDiagCPError:
    if my_reason:  # this rank's own account, which has the value
        text = f"CP rank {rank} {INVALID_REASONS[my_reason]}: {detail}"
        if first != rank:
            text += f" (CP rank {first} {INVALID_REASONS[reason]} too)"
    else:
        text = (f"CP rank {first} {INVALID_REASONS[reason]} (this rank, CP rank {rank}, was at {KINDS[kind]}; "
                f"CP rank {first}'s own error gives the value)")
    return BlockDiagCPError(text + "; raised on every CP rank, so none is left waiting in a collective")


# ---------------------------------------------------------------------------
# Document-id fingerprint
# ---------------------------------------------------------------------------

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijection of uint64 that spreads every input bit."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def doc_ids_fingerprint(ids: torch.Tensor) -> int:
    """64-bit hash of the run-length encoding of [R, S] int64 document ids.

    Every run contributes mix(mix(row, start) + value); the sum (mod 2**64) over
    runs depends only on the runs themselves, and the non-linear
    per-position mixing leaves simple permutations and swapped values no common
    weighted sum to collide on. O(S), vectorized: ~2 ms at S = 1M.
    """
    a = ids.numpy()
    change = np.ones(a.shape, dtype=bool)
    change[:, 1:] = a[:, 1:] != a[:, :-1]
    rows, starts = np.nonzero(change)
    values = a[rows, starts].astype(np.uint64)
    position = (rows.astype(np.uint64) << np.uint64(40)) ^ starts.astype(np.uint64)
    with np.errstate(over="ignore"):
        words = _mix64(_mix64(position + _GOLDEN) + values * _GOLDEN)
        total = words.sum(dtype=np.uint64) ^ np.uint64(len(values))
    return int(np.array([total], dtype=np.uint64).view(np.int64)[0])


# ---------------------------------------------------------------------------
# Kernel failures waiting for an agreement point
# ---------------------------------------------------------------------------


class PendingKernelFailures:
    """Failures recorded on this process that no agreement point has raised yet."""

    def __init__(self):
        self._messages: List[str] = []
        self._lock = threading.Lock()

    def record(self, message: str) -> None:
        with self._lock:
            self._messages.append(message)

    def count(self) -> int:
        return len(self._messages)

    def take(self) -> List[str]:
        with self._lock:
            messages, self._messages = self._messages, []
        return messages


PENDING_KERNEL_FAILURES = PendingKernelFailures()


def kernel_failure_error(mine: List[str], where: str) -> BlockDiagCPError:
    text = "; ".join(mine) if mine else "this rank's kernels succeeded"
    dense_failed = any(m.startswith("dense ") for m in mine)
    advice = ("the dense kernel itself failed: check the message above (out of memory, a NaN check, "
              "bad inputs); no other backend is left to fall back to" if dense_failed else
              "rerun with --cp-attn-backend dense (or attn_backend='dense') to isolate it")
    return BlockDiagCPError(
        f"an attention kernel failed on at least one CP rank {where} (raised on every rank; "
        f"gradients of that step are not valid; this rank: {text}); {advice}")


def agree_on_kernel_failures(group, cp: int) -> None:
    """End of a step: one tiny all-reduce; raises on every rank if any kernel failed anywhere.

    Takes (and clears) every failure pending on this process: this step's, and any
    recorded outside a step since the last agreement point.
    """
    mine = PENDING_KERNEL_FAILURES.take()
    facts = agree({"failed": 1 if mine else 0}, group, cp, kind=KIND_STEP_END)
    if facts.max("failed"):
        raise raised_on_every_rank(kernel_failure_error(mine, "during this step"))


def agree_on_step_abort(group, cp: int, failure: Exception) -> None:
    """A step that exits with ``failure`` joins its peers' pending agreement as invalid.

    Whatever agreement the peers are at (an attention call's q/k/v, the end of their
    step, the next build), they and this rank raise the same ``BlockDiagCPError``, this
    rank's chained to ``failure``. Kernel failures pending here are dropped with it:
    the step's gradients are not valid anyway.
    """
    PENDING_KERNEL_FAILURES.take()
    try:
        agree({}, group, cp, kind=KIND_STEP_END, invalid=INVALID_STEP_RAISED,
              detail=f"{type(failure).__name__}: {failure}")
    except Exception as error:  # ours, or the collective's own (its timeout): both name the cause
        raise error from failure


# ---------------------------------------------------------------------------
# One step at a time per process
# ---------------------------------------------------------------------------


class BuildGuard:
    """Refuses a second concurrent ``build`` on the same CP group in one process.

    Two threads building at once would pair each other's all-reduces across ranks
    and report nonsense ("doc_ids differ"); the published step state is
    process-wide too. Megatron runs one step at a time per process.
    """

    def __init__(self):
        self._busy: Dict[Tuple[int, ...], int] = {}
        self._lock = threading.Lock()

    def enter(self, ranks: Tuple[int, ...]) -> None:
        me = threading.get_ident()
        with self._lock:
            owner = self._busy.get(ranks)
            if owner is not None and owner != me:
                raise BlockDiagCPError(
                    f"BlockDiagCPState.build on CP ranks {list(ranks)} was called from two threads at "
                    "once; block-diagonal CP runs one step at a time per process (the step state is "
                    "process-wide): serialize the steps, or give each thread its own process")
            self._busy[ranks] = me

    def exit(self, ranks: Tuple[int, ...]) -> None:
        with self._lock:
            self._busy.pop(ranks, None)


BUILD_GUARD = BuildGuard()


def group_ranks(group) -> Tuple[int, ...]:
    return (0,) if group is None else tuple(dist.get_process_group_ranks(group))
