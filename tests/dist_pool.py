"""A pool of gloo worker processes, spawned once per test module.

Process start and imports cost seconds, so tests send work to long-lived ranks:
``pool.run(fn, *args)`` calls module-level ``fn(*args)`` on every rank (the
function's module is imported by file path in the workers) and returns the list
of per-rank results. A hang fails after ``timeout`` seconds and the pool is
rebuilt; an exception on any rank is re-raised here with that rank's traceback.
"""

import importlib.util
import os
import socket
import sys
import traceback

import torch.multiprocessing as mp

_CTX = mp.get_context("spawn")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load(path: str):
    name = "_pool_" + os.path.splitext(os.path.basename(path))[0]
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _worker(rank, world, port, tasks, results, env):
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
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
    def __init__(self, world: int, env=None):
        self.world = world
        self.env = dict(env or {})
        self._start()

    def _start(self):
        port = _free_port()
        self.tasks = [_CTX.Queue() for _ in range(self.world)]
        self.results = _CTX.Queue()
        env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", **self.env}
        self.procs = [_CTX.Process(target=_worker, daemon=True,
                                   args=(r, self.world, port, self.tasks[r], self.results, env))
                      for r in range(self.world)]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout: float = 180.0):
        path = os.path.abspath(sys.modules[fn.__module__].__file__)
        for q in self.tasks:
            q.put((path, fn.__name__, args))
        out, errors = [None] * self.world, []
        import queue
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
        for p, q in zip(self.procs, self.tasks):
            if not kill:
                q.put(None)
        for p in self.procs:
            p.join(timeout=0 if kill else 10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
