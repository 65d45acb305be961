"""Process lifecycle: the launcher rendezvous (torchrun or srun), process groups, devices.

Megatron-LM's ``initialize_megatron`` plus what a CPU run under torchrun needs:
workers that die with their launcher, gloo kept on loopback on one machine, and
the SLURM rendezvous derived on every rank without a shared file.
"""

import ctypes
import dataclasses
import datetime
import os
import socket
import subprocess
import sys
from typing import Any, Optional

from .arguments import world_from_env
from .logs import log


@dataclasses.dataclass
class ParallelContext:
    """This process's place in the run; the groups are megatron-core parallel_state's."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    backend: str
    device: Any = None
    bf16: bool = False
    dp_rank: int = 0
    dp_group: Any = None
    dp_cp_group: Any = None  # gradients are summed over data- x context-parallel ranks
    dp_cp_size: int = 1
    tp_group: Any = None
    t0: float = 0.0


def die_with_launcher() -> None:
    """Under torchrun, die when the launcher dies (even by SIGKILL), like srun's tasks.

    torchrun starts workers in their own sessions; if torchrun itself is SIGKILLed
    they would otherwise run on, orphaned, and keep writing checkpoints.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG, SIGKILL = 1, 9
        failed = libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0
    except (OSError, AttributeError) as exc:  # no libc with prctl (e.g. a static or musl build)
        failed, why = True, str(exc)
    else:
        why = os.strerror(ctypes.get_errno())
    if failed:
        # Training still works; only a SIGKILLed torchrun would leave this worker orphaned.
        sys.stderr.write(f"[pretrain_gpt] warning: prctl(PR_SET_PDEATHSIG) failed ({why}); this "
                         "worker will outlive a killed launcher\n")
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)


def _scontrol(*argv: str) -> Optional[str]:
    """scontrol's output, or None when it cannot answer (not installed, no controller, timeout)."""
    try:
        return subprocess.run(["scontrol", *argv], capture_output=True, text=True, timeout=30,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return None


def _slurm_first_node_addr() -> str:
    """The rendezvous host under srun without MASTER_ADDR: the allocation's first node.

    Every rank derives the same answer. Without a usable scontrol the best guess is this
    host: right for one node, and a multi-node job then fails at the rendezvous with
    torch's timeout naming the address, which says what to set (MASTER_ADDR).
    """
    nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "")
    hosts = (_scontrol("show", "hostnames", nodelist) or "").split()
    if not hosts:
        return socket.gethostname()
    # NodeAddr may differ from the node name (emulated nodes, private networks)
    for field in (_scontrol("show", "node", hosts[0], "-o") or "").split():
        if field.startswith("NodeAddr="):
            return field.split("=", 1)[1]
    return hosts[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _is_loopback(addr: str) -> bool:
    try:
        return socket.gethostbyname(addr).startswith("127.")
    except OSError:  # an unresolvable name is not loopback; init_process_group will say more
        return False


def initialize_distributed(args, t0: float) -> ParallelContext:
    """init_process_group + megatron-core parallel_state with TP and CP; DP takes the rest."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    rank, world, local_rank, local_world = world_from_env()
    if "OMP_NUM_THREADS" not in os.environ:  # torchrun sets 1; an explicit value wins
        cores = len(os.sched_getaffinity(0))
        torch.set_num_threads(max(1, cores // max(1, local_world)))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(local_world))
    if "MASTER_ADDR" not in os.environ:
        os.environ["MASTER_ADDR"] = _slurm_first_node_addr() if "SLURM_PROCID" in os.environ \
            else "127.0.0.1"
    if "MASTER_PORT" not in os.environ:
        if "SLURM_JOB_ID" in os.environ:  # every rank derives the same port
            os.environ["MASTER_PORT"] = str(20000 + int(os.environ["SLURM_JOB_ID"]) % 20000)
        elif world == 1:
            os.environ["MASTER_PORT"] = str(_free_port())
        else:
            os.environ["MASTER_PORT"] = "29500"
    backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ and (
            _is_loopback(os.environ["MASTER_ADDR"]) or local_world == world):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo on one machine: stay on loopback
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    dist.init_process_group(backend=backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))
    mpu.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                  context_parallel_size=args.context_parallel_size)

    ctx = ParallelContext(rank=rank, world=world, local_rank=local_rank, local_world=local_world,
                          backend=backend, t0=t0)
    ctx.device = torch.device("cuda", torch.cuda.current_device()) \
        if torch.cuda.is_available() else torch.device("cpu")
    ctx.bf16 = bool(args.bf16) if args.bf16 is not None else ctx.device.type == "cuda"
    if ctx.bf16 and ctx.device.type != "cuda":
        log("[pretrain_gpt] WARNING: --bf16 on CPU is slow and only autocast on CUDA is "
            "implemented; running fp32", ctx)
        ctx.bf16 = False
    args.bf16 = ctx.bf16
    ctx.dp_rank = mpu.get_data_parallel_rank()
    ctx.dp_group = mpu.get_data_parallel_group()
    ctx.dp_cp_group = mpu.get_data_parallel_group(with_context_parallel=True)
    ctx.dp_cp_size = mpu.get_data_parallel_world_size(with_context_parallel=True)
    ctx.tp_group = mpu.get_tensor_model_parallel_group()
    return ctx


def shutdown_distributed() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    mpu.destroy_model_parallel()
    dist.destroy_process_group()
