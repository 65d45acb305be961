"""Test and benchmark helpers for megatron-ext: one installed home, used by tests/, scripts/bench/
and the GPU check (``scripts/gpu_check.sh``). Not part of the engine's public face.

- ``pool``: ``WorkerPool``, long-lived gloo ranks on loopback (``pool.run(fn, *args)``), and ``catch``;
- ``reference``: the independent dense per-document causal attention (``reference_attention``);
- ``cases``: the doc-id cases of the distributed tests (``CASES``, ``make_doc_ids(case, S, cp)``);
- ``mixes``: the benchmarks' document-length mixes and the GPU check's packed mix;
- ``doubles``: plain-torch doubles behind the flash and TE kernel contracts;
- ``overrides``: the engine's test hooks as context managers (``override_kernel``,
  ``override_availability``, ``override_library(ies)``, ``captured_engine_logs``);
- ``timing``: CUDA-event / wall-clock timers, the measured matmul peak, per-rank kernel timing;
- ``isolation``: make megatron-core unimportable, as on a machine without it;
- ``gpt``: GPTModel builders and a single-process reference for the model tests (imports
  megatron-core inside its functions);
- ``slurm``: a throw-away SLURM cluster on this machine for the SLURM test.

Nothing here imports megatron-core or the engine at import time.
"""

from .overrides import (
    captured_engine_logs,
    override_availability,
    override_kernel,
    override_libraries,
    override_library,
)
from .pool import WorkerPool, catch, pool_fixture, pool_per_cp_fixture
from .reference import doc_mask, reference_attention, ring_routes, runs_to_doc_ids
from .timing import matmul_tflops, median_ms

__all__ = [
    "WorkerPool", "captured_engine_logs", "catch", "doc_mask", "matmul_tflops", "median_ms",
    "override_availability", "override_kernel", "override_libraries", "override_library", "pool_fixture",
    "pool_per_cp_fixture", "reference_attention", "ring_routes", "runs_to_doc_ids",
]
