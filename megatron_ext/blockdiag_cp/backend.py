"""Which attention kernel runs: te -> flash -> dense, chosen by every CP rank together.

Per step, ``BlockDiagCPState.build`` reduces every rank's static availability
(installed, CUDA) with MAX, so a kernel counts as available only where all ranks
can run it; ``resolve_backend`` then walks the fallback chain from the requested
backend. Per call, ``call_backend`` checks what depends on q (dtype, device,
dropout); those are identical on every rank, so every rank falls back alike.
Each fallback is logged once per process (INFO for the default request, WARNING
for an explicit one); strict mode turns it into an error.
"""

import logging
import threading
from typing import Dict, Tuple

from . import kernels
from .agreement import BlockDiagCPError
from .state import ATTN_BACKEND_VALUES

logger = logging.getLogger("megatron_ext.blockdiag_cp")

_LOGGED = set()
_LOG_LOCK = threading.Lock()


def log_once(level: int, message: str) -> None:
    with _LOG_LOCK:
        if message in _LOGGED:
            return
        _LOGGED.add(message)
    logger.log(level, message)


def resolve_backend(requested: str, available: Dict[str, bool], static: Dict[str, tuple],
                    explicit: bool) -> Tuple[str, str]:
    """(backend, reason): the first backend from ``requested`` on that every rank can run."""
    order = ATTN_BACKEND_VALUES[ATTN_BACKEND_VALUES.index(requested):]
    skipped = []
    for backend in order:
        if available[backend]:
            if not skipped:
                return backend, static[backend][1]
            reason = "; ".join(skipped)
            log_once(logging.WARNING if explicit else logging.INFO,
                     f"blockdiag-cp: attention backend {requested} -> {backend}: {reason}")
            return backend, f"fell back to {backend}: {reason}"
        why = static[backend][1] if not static[backend][0] else "unavailable on another CP rank"
        skipped.append(f"{backend}: {why}")
    raise AssertionError("dense is always available")


def call_backend(state, q, dropout_p: float, kv_heads: int = None) -> str:
    """The backend for this call; falls back (or raises under strict) on dtype/device/dropout/heads."""
    backend = state.attn_backend
    while True:
        ok, reason = kernels.call_availability(backend, q, dropout_p, kv_heads)
        if ok:
            return backend
        # Same dtype/device/dropout on every rank (agreed per call), so every rank takes this branch.
        if state.strict:
            raise BlockDiagCPError(f"strict mode: attention backend {backend!r} cannot take this call "
                                   f"({reason}); drop strict or change dtype/dropout")
        nxt = ATTN_BACKEND_VALUES[ATTN_BACKEND_VALUES.index(backend) + 1]
        while not state.available[nxt]:
            nxt = ATTN_BACKEND_VALUES[ATTN_BACKEND_VALUES.index(nxt) + 1]
        level = logging.WARNING if state.backend_explicit else logging.INFO
        log_once(level, f"blockdiag-cp: attention backend {backend} -> {nxt} for this call: {reason}")
        state.attn_backend_reason = f"fell back to {nxt}: {backend}: {reason}"
        state.attn_backend = backend = nxt
