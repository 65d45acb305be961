"""Cross-rank agreement: the few small all-reduces that keep every CP rank on the same path.

A rank that takes a different branch from its peers (another collective, another
size, an error the others never see) hangs the group until the process-group
timeout. So every decision that depends on rank-local facts is taken from a
reduced vector that every rank holds identically:

- once per step, ``BlockDiagCPState.build`` reduces the input verdict, the
  document-id fingerprint, the sequence shape, the requested knobs, the kernels
  each rank can run, and the kernel failures not yet raised;
- once per attention forward call (CP > 1), the q/k/v shape and dtype signature,
  so a rank whose tensors are off raises together with the others instead of
  leaving them waiting in the K/V exchange;
- at the end of a ``blockdiag_cp_step``, the kernel failures of that step.

Each fact x rides as the pair (x, ~x) in one int64 MAX all-reduce: the maximum of
~x is ~min(x), so every rank learns max and min (and so whether all ranks agree)
from a single collective.

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
    """Raised identically on every CP rank."""


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


def agree(facts: Dict[str, int], group, cp: int, device=None) -> AgreedFacts:
    """One int64 MAX all-reduce of (x, ~x) for every fact; a plain copy when cp == 1.

    NCCL reduces on ``device`` (the caller's tensors' device; default the current
    CUDA device); other backends on the CPU.
    """
    names = list(facts)
    local = []
    for name in names:
        value = int(facts[name])
        local += [value, ~value]
    if cp == 1:
        return AgreedFacts(names, local)
    vec = torch.tensor(local, dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        vec = vec.to(device) if device is not None and torch.device(device).type == "cuda" else vec.cuda()
    dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
    return AgreedFacts(names, vec.cpu().tolist())


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
    facts = agree({"failed": 1 if mine else 0}, group, cp)
    if facts.max("failed"):
        raise kernel_failure_error(mine, "during this step")


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
