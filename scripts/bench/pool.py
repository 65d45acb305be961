"""A pool of long-lived gloo worker processes (one per CP rank) for the benchmarks.

The same pattern as tests/dist_pool.py (benchmarks must not import from tests/):
process start and imports cost seconds, so each suite spawns one pool per CP size
and sends it work. ``pool.run(fn, *args)`` calls the module-level ``fn(*args)`` on
every rank (the module is imported by file path in the workers, so anything in
scripts/bench is importable there) and returns the per-rank results. A rank that
raises fails the call with its traceback; a hang fails after ``timeout`` seconds
and the pool is rebuilt.
"""

import importlib.util
import os
import queue
import socket
import sys
import traceback

import torch.multiprocessing as mp

_CTX = mp.get_context("spawn")
BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(BENCH_DIR))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load(path: str):
    name = "_bench_" + os.path.splitext(os.path.basename(path))[0]
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _worker(rank, world, port, tasks, results, env, threads):
    os.environ.update(env)
    for p in (REPO_ROOT, BENCH_DIR):
        if p not in sys.path:
            sys.path.insert(0, p)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    while True:
        task = tasks.get()
        if task is None:
            break
        path, name, args = task
        try:
            results.put((rank, True, getattr(_load(path), name)(*args)))
        except BaseException:  # noqa: BLE001 - shipped to the parent
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class WorkerPool:
    """``world`` gloo ranks on loopback, ``threads`` intra-op threads each."""

    def __init__(self, world: int, threads: int = 1, env=None):
        self.world = world
        self.threads = threads
        self.env = dict(env or {})
        self._start()

    def _start(self):
        port = _free_port()
        self.tasks = [_CTX.Queue() for _ in range(self.world)]
        self.results = _CTX.Queue()
        # LOCAL_WORLD_SIZE as torchrun sets it: every rank is on this one machine (one node).
        env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": str(self.threads),
               "LOCAL_WORLD_SIZE": str(self.world), **self.env}
        self.procs = [_CTX.Process(target=_worker, daemon=True,
                                   args=(r, self.world, port, self.tasks[r], self.results, env,
                                         self.threads))
                      for r in range(self.world)]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout: float = 600.0):
        module = sys.modules[fn.__module__]
        path = os.path.abspath(module.__file__)
        for q in self.tasks:
            q.put((path, fn.__name__, args))
        out, errors = [None] * self.world, []
        for _ in range(self.world):
            try:
                rank, ok, value = self.results.get(timeout=timeout)
            except queue.Empty:
                self.restart()
                raise TimeoutError(f"{fn.__name__}: no result within {timeout}s (a rank hung); "
                                   f"errors so far: {errors}")
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise RuntimeError(f"{fn.__name__} failed:\n" + "\n".join(errors))
        return out

    def restart(self):
        self.close(kill=True)
        self._start()

    def close(self, kill: bool = False):
        if not kill:
            for q in self.tasks:
                q.put(None)
        for p in self.procs:
            p.join(timeout=0 if kill else 10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(kill=exc[0] is not None)
