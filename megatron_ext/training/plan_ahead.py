"""Plan the next micro batch while the current one trains.

The CP engine's host work per step is the layout and plan of the micro batch's
documents (``prepare_plan``: no process group, no device); only the agreement
all-reduce must run in line. ``PlanAhead`` wraps the data iterator: a background
thread fetches micro batch i+1 and builds its plan while micro batch i runs, and
hands each batch over with its ``PreparedPlan`` under ``PREPARED_KEY``::

    main thread     | step i (forward, backward)     | step i+1 ...
    planning thread | fetch + plan i+1 |  (idle)     | fetch + plan i+2 |

``exposed`` is what the main thread still waited for; ``seconds - exposed`` of
the plan was hidden behind the step.
"""

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator

PREPARED_KEY = "cp_prepared_plan"
TIMING_KEY = "cp_plan_timing"


@dataclass(frozen=True)
class PlanTiming:
    seconds: float  # the plan's host time on the planning thread
    exposed: float  # how long the step waited for fetch + plan (0 when fully hidden)

    @property
    def hidden(self) -> float:
        return max(0.0, self.seconds - self.exposed)


class PlanAhead:
    """Micro batches (dicts) with their plan built one step ahead on a background thread."""

    def __init__(self, batches: Iterator[dict], plan: Callable[[dict], object]):
        self._batches, self._plan = batches, plan
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cp-plan-ahead")
        self._next = self._pool.submit(self._fetch_and_plan)

    def _fetch_and_plan(self):
        batch = next(self._batches)
        start = time.perf_counter()
        prepared = self._plan(batch)
        return batch, prepared, time.perf_counter() - start

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        start = time.perf_counter()
        batch, prepared, seconds = self._next.result()  # re-raises the planning thread's error here
        exposed = time.perf_counter() - start
        self._next = self._pool.submit(self._fetch_and_plan)
        return dict(batch, **{PREPARED_KEY: prepared, TIMING_KEY: PlanTiming(seconds, exposed)})

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
