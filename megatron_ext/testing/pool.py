"""A pool of long-lived gloo worker processes on loopback, one per CP rank, for tests and benchmarks.

Process start and imports cost seconds, so a test module or a benchmark suite spawns
one pool per CP size and sends it work: ``pool.run(fn, *args)`` calls the module-level
``fn(*args)`` on every rank and returns the per-rank results. A module of an installed
package (``megatron_ext.testing.*``) is imported by name in the workers; any other module
(a test file, a benchmark suite) is loaded from its file, and the workers inherit the
parent's ``sys.path`` (spawn hands it over), so its own imports resolve as in the parent.

A rank that raises fails the call with its traceback; a hang fails after ``timeout``
seconds (180 unless the pool or the call says otherwise) and the pool is rebuilt, so
the next call starts from clean ranks.
"""

import importlib
import importlib.util
import os
import queue
import socket
import sys
import time
import traceback

import torch.multiprocessing as mp

_CTX = mp.get_context("spawn")
_PARENT_POLL_S = 2.0  # how often an idle worker checks its parent, and a waiting parent its workers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load(module_name: str, path: str):
    if "." in module_name:  # a package module: the workers import the same one by name
        try:
            module = importlib.import_module(module_name)
            if os.path.abspath(module.__file__) == path:
                return module
        except ImportError:
            pass  # e.g. a test module pytest named after its folder: load it from its file
    name = "_pool_" + os.path.splitext(os.path.basename(path))[0]
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _worker(rank, world, port, tasks, results, env, threads):
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=_PARENT_POLL_S)
        except queue.Empty:
            if os.getppid() != parent:  # the parent died without closing us: do not linger holding memory
                break
            continue
        if task is None:
            break
        module_name, path, fn_name, args = task
        try:
            results.put((rank, True, getattr(_load(module_name, path), fn_name)(*args)))
        except BaseException:  # noqa: BLE001 - shipped to the parent
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class WorkerPool:
    """``world`` gloo ranks on 127.0.0.1, ``threads`` intra-op threads each, ``env`` set in each."""

    def __init__(self, world: int, threads: int = 1, env=None, timeout: float = 180.0):
        self.world = world
        self.threads = threads
        self.env = dict(env or {})
        self.timeout = timeout
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

    def run(self, fn, *args, timeout: float = None):
        timeout = self.timeout if timeout is None else timeout
        module = sys.modules[fn.__module__]
        task = (fn.__module__, os.path.abspath(module.__file__), fn.__name__, args)
        for q in self.tasks:
            q.put(task)
        out, errors = [None] * self.world, []
        for _ in range(self.world):
            try:
                rank, ok, value = self._next_result(fn.__name__, timeout)
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

    def _next_result(self, name: str, timeout: float):
        """The next rank's result; a rank that died (killed, e.g. out of memory) fails the call at once
        instead of after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.results.get(timeout=min(_PARENT_POLL_S, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self.procs) if p.exitcode is not None]
                if dead:
                    self.restart()
                    raise RuntimeError(f"{name}: worker rank(s) died: " + ", ".join(
                        f"rank {r} exit code {code}" for r, code in dead) + " (-9: killed, e.g. out of memory)")
                if time.monotonic() >= deadline:
                    raise

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


def catch(fn):
    """(exception type name, message) of ``fn()``, or None; for per-rank error checks."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - returned to the parent for its assertion
        return type(exc).__name__, str(exc)
    return None


def pool_fixture(world: int, **kwargs):
    """A module-scoped pytest fixture: a ``WorkerPool(world, **kwargs)``, closed after the module.

    ``pool2 = pool_fixture(2)`` at a test module's top level; pytest imports lazily here so
    the bench, which never uses fixtures, does not need pytest.
    """
    import pytest

    @pytest.fixture(scope="module")
    def fixture():
        pool = WorkerPool(world, **kwargs)
        yield pool
        pool.close()

    return fixture


def pool_per_cp_fixture(worlds, **kwargs):
    """A module-scoped fixture parametrized over CP sizes: a ``WorkerPool(cp, **kwargs)`` per size in
    ``worlds`` (test ids ``cp2``, ...), each closed before the next opens.

    ``pool = pool_per_cp_fixture([2, 3, 4])`` at a test module's top level.
    """
    import pytest

    @pytest.fixture(scope="module", params=list(worlds), ids=lambda n: f"cp{n}")
    def fixture(request):
        pool = WorkerPool(request.param, **kwargs)
        yield pool
        pool.close()

    return fixture
