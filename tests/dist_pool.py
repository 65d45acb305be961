"""The gloo worker pool for tests: scripts/bench/pool.py's, spawned once per test module.

Process start and imports cost seconds, so tests send work to long-lived ranks with
``pool.run(fn, *args)`` (module-level ``fn``, imported by file path in the workers).
Here a hang fails after 180 s by default (pytest-timeout bounds each test as well).
"""

import os
import sys

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "bench")
if _BENCH not in sys.path:
    sys.path.insert(0, _BENCH)  # spawned workers inherit sys.path, so they find it too

from pool import WorkerPool as _BenchPool  # noqa: E402


class WorkerPool(_BenchPool):
    def run(self, fn, *args, timeout: float = 180.0):
        return super().run(fn, *args, timeout=timeout)


def catch(fn):
    """(exception type name, message) of ``fn()``, or None; for per-rank error checks."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    return None
