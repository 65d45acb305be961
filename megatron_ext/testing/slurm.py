"""A real, throw-away SLURM cluster on this machine: munged + slurmctld + N emulated slurmd nodes.

Everything (config, state, spool, logs, pid files, the munge socket) lives in one temp
folder; nothing under /etc or /run is touched except reading /etc/munge/munge.key.
Every daemon this starts is stopped by ``stop()`` (SIGTERM by pid file, in the order
slurmd, slurmctld, munged; SIGKILL after a grace period) and verified gone.

    with SlurmCluster(nodes=("n1", "n2"), cpus_per_node=2) as cluster:
        rc, out = cluster.sbatch_wait(["-N2", "--ntasks-per-node=2", script], minutes=5)

Needs root (slurmd runs jobs as the submitting user; munged runs as the `munge` user).
"""

import os
import pathlib
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

SLURM_COMMANDS = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "munged")


def _which(cmd: str) -> Optional[str]:
    return shutil.which(cmd) or next(
        (p for p in (f"/usr/sbin/{cmd}", f"/usr/bin/{cmd}") if os.access(p, os.X_OK)), None)


def missing_requirements() -> List[str]:
    """What is missing to run a cluster here (empty list: ready)."""
    missing = [cmd for cmd in SLURM_COMMANDS if _which(cmd) is None]
    if not os.path.isfile("/etc/munge/munge.key"):
        missing.append("/etc/munge/munge.key")
    if os.geteuid() != 0:
        missing.append("root privileges")
    try:
        pwd.getpwnam("munge")
    except KeyError:
        missing.append("user 'munge'")
    return missing


def _free_ports(n: int) -> List[int]:
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


class SlurmCluster:
    def __init__(self, nodes: Sequence[str] = ("n1", "n2"), cpus_per_node: int = 2,
                 real_memory_mb: int = 4000, root: Optional[str] = None):
        self.nodes = list(nodes)
        self.cpus = cpus_per_node
        self.memory = real_memory_mb
        self.root = pathlib.Path(root or tempfile.mkdtemp(prefix="mext-slurm-"))
        self.conf = self.root / "slurm.conf"
        # munged runs as the `munge` user, which must reach its socket folder: give it a
        # folder of its own directly under /tmp (a pytest tmp_path sits below a 0700 dir).
        self.munge_dir = pathlib.Path(tempfile.mkdtemp(prefix="mext-munge-"))
        self.munge_socket = self.munge_dir / "munge.socket"
        self.pidfiles: List[Tuple[str, pathlib.Path]] = []  # (name, pid file) in start order
        self.started = False

    # ------------------------------------------------------------------ environment
    @property
    def env(self) -> Dict[str, str]:
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        for var in [v for v in env if v.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
            if var != "SLURM_CONF":
                del env[var]
        return env

    def run(self, args: Sequence[str], timeout: float = 60, check: bool = True,
            **kw) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), env=kw.pop("env", self.env), capture_output=True,
                              text=True, timeout=timeout, check=check, **kw)

    # ------------------------------------------------------------------ config
    def _write_config(self) -> None:
        ctld_port, *node_ports = _free_ports(1 + len(self.nodes))
        r = self.root
        for sub in ("state", "log", "spool", "jobs"):
            (r / sub).mkdir(parents=True, exist_ok=True)
        for node in self.nodes:
            (r / "spool" / node).mkdir(parents=True, exist_ok=True)
        lines = [
            "ClusterName=mext",
            f"SlurmctldHost={socket.gethostname()}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={r}/log/jobcomp.txt",
            "CommunicationParameters=NoInAddrAny,NoCtldInAddrAny",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "MinJobAge=4",
            "ReturnToService=2",
            "SlurmdTimeout=60",
            "InactiveLimit=0",
            "KillWait=5",
        ]
        for node, port in zip(self.nodes, node_ports):
            lines.append(f"NodeName={node} NodeAddr=127.0.0.1 NodeHostname={node} Port={port} "
                         f"CPUs={self.cpus} RealMemory={self.memory} State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES "
                     "MaxTime=INFINITE State=UP OverSubscribe=NO")
        self.conf.write_text("\n".join(lines) + "\n")

    # ------------------------------------------------------------------ start / stop
    def _wait_pidfile(self, path: pathlib.Path, what: str, timeout: float = 30) -> int:
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                pid = int(path.read_text().strip())
                if _pid_alive(pid):
                    return pid
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{what} did not start (no live pid in {path});\n{self.logs()}")

    def start(self, timeout: float = 60) -> "SlurmCluster":
        missing = missing_requirements()
        if missing:
            raise RuntimeError(f"cannot start SLURM here, missing: {', '.join(missing)}")
        self.root.mkdir(parents=True, exist_ok=True)
        self._write_config()
        munge_user = pwd.getpwnam("munge")
        os.chmod(self.munge_dir, 0o755)
        os.chown(self.munge_dir, munge_user.pw_uid, munge_user.pw_gid)
        self.started = True
        try:
            pid_munge = self.munge_dir / "munged.pid"
            subprocess.run(
                ["runuser", "-u", "munge", "--", _which("munged"), f"--socket={self.munge_socket}",
                 f"--pid-file={pid_munge}", f"--log-file={self.munge_dir / 'munged.log'}",
                 f"--seed-file={self.munge_dir / 'munged.seed'}"],
                check=True, timeout=30, capture_output=True, text=True)
            self.pidfiles.append(("munged", pid_munge))
            self._wait_pidfile(pid_munge, "munged")

            self.run([_which("slurmctld"), "-i"], timeout=30)  # -i: ignore stale state
            self.pidfiles.append(("slurmctld", self.root / "slurmctld.pid"))
            self._wait_pidfile(self.root / "slurmctld.pid", "slurmctld")
            for node in self.nodes:
                self.run([_which("slurmd"), "-N", node], timeout=30)
                self.pidfiles.append((f"slurmd {node}", self.root / f"slurmd-{node}.pid"))
                self._wait_pidfile(self.root / f"slurmd-{node}.pid", f"slurmd {node}")
            self.wait_idle(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_idle(self, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        out = ""
        while time.time() < deadline:
            res = self.run(["sinfo", "-h", "-t", "idle", "-o", "%D"], check=False, timeout=15)
            out = res.stdout + res.stderr
            if res.returncode == 0 and sum(int(x) for x in res.stdout.split() if x.isdigit()) \
                    == len(self.nodes):
                return
            time.sleep(0.3)
        raise RuntimeError(f"nodes not idle after {timeout}s: {out}\n{self.logs()}")

    def stop(self, grace: float = 20) -> List[str]:
        """SIGTERM every daemon by pid file (slurmd, slurmctld, munged); returns survivors (should be [])."""
        order = sorted(self.pidfiles, key=lambda item: {"slurmd": 0, "slurmctld": 1,
                                                         "munged": 2}[item[0].split()[0]])
        survivors = []
        for name, path in order:
            try:
                pid = int(path.read_text().strip())
            except (OSError, ValueError):
                continue
            if not _pid_alive(pid):
                continue
            os.kill(pid, signal.SIGTERM)
            deadline = time.time() + grace
            while _pid_alive(pid) and time.time() < deadline:
                time.sleep(0.1)
            if _pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
                time.sleep(0.5)
            if _pid_alive(pid):
                survivors.append(f"{name} (pid {pid})")
        self.pidfiles = []
        self.started = False
        if not survivors:
            shutil.rmtree(self.munge_dir, ignore_errors=True)
        return survivors

    def daemon_pids(self) -> Dict[str, int]:
        pids = {}
        for name, path in self.pidfiles:
            try:
                pids[name] = int(path.read_text().strip())
            except (OSError, ValueError):
                pass
        return pids

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ jobs
    def sbatch_wait(self, args: Iterable[str], minutes: int, timeout: Optional[float] = None,
                    env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None
                    ) -> Tuple[int, str]:
        """``sbatch --wait -t minutes ARGS``: (exit code, sbatch's stdout+stderr)."""
        full_env = self.env
        full_env.update(env or {})
        res = subprocess.run(["sbatch", "--wait", "-t", str(minutes), *args], env=full_env,
                             cwd=cwd, capture_output=True, text=True,
                             timeout=timeout or minutes * 60 + 90)
        return res.returncode, res.stdout + res.stderr

    def logs(self, tail: int = 30) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")) + [self.munge_dir / "munged.log"]:
            try:
                lines = path.read_text(errors="replace").splitlines()[-tail:]
            except OSError:
                continue
            parts.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)

