"""A real single-node Slurm cluster for the launch tests, started and stopped by the tests themselves.

    with SlurmCluster(tmp_path) as cluster:      # installs Slurm + munge if missing (root), starts the daemons
        ...                                       # sbatch / squeue / scontrol / submitit reach it (SLURM_CONF)

Everything the cluster writes (config, state, spool, logs, pid files) lives under the given folder; the
daemons are stopped by their pid files when the block ends. The configuration follows
../shared/ENVIRONMENT.md ("A real Slurm on one machine"), plus what the launcher relies on:
`SlurmctldParameters=preempt_send_user_signal` (preemption delivers the job's --signal, USR2, as a
cluster must be configured for a preempted job to checkpoint), `KillOnBadExit=1` (a rank that exits non-zero ends
its step: the launcher's rank 0 must requeue before the others exit), and short timers so that requeued jobs
start again within seconds.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.machine_speed import scaled

PACKAGES = ("slurm-wlm", "munge")


def ensure_installed() -> None:
    """Install Slurm and munge from Debian's packages if they are missing (needs root)."""
    if shutil.which("slurmctld") and shutil.which("munged"):
        return
    if os.geteuid() != 0:
        raise RuntimeError(f"the launch tests need a local Slurm: run them as root, or install {' '.join(PACKAGES)}")
    subprocess.run(["apt-get", "update", "-qq"], check=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", *PACKAGES], check=True,
                   env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def memory_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 4096


class SlurmCluster:
    def __init__(self, root: Path, cpus: int | None = None):
        self.root = Path(root)
        self.host = socket.gethostname().split(".")[0]
        self.cpus = cpus or os.cpu_count() or 2
        self.conf = self.root / "slurm.conf"
        self.started: list[Path] = []          # pid files of the daemons this object started

    # ---- configuration ----
    def write_config(self) -> None:
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        memory = int(memory_mb() * 0.8)
        self.conf.write_text("\n".join([
            "ClusterName=hardviewtest",
            f"SlurmctldHost={self.host}",
            "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge",
            # A requeued job waits cred_expire seconds before it may start again (default 120).
            "AuthInfo=cred_expire=10",
            f"StateSaveLocation={self.root / 'state'}", f"SlurmdSpoolDir={self.root / 'spool'}",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}", f"SlurmdPidFile={self.root / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.root / 'log/slurmctld.log'}", f"SlurmdLogFile={self.root / 'log/slurmd.log'}",
            f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "ReturnToService=2", "MpiDefault=none",
            # What a cluster needs for preemption to reach a job as its --signal (USR2), so it can checkpoint.
            "SlurmctldParameters=preempt_send_user_signal",
            # Short timers: a test waits seconds, not minutes, for a requeued job to start again.
            "SchedulerParameters=defer_batch,sched_interval=2", "KillWait=20",
            # An ended job's record stays for as long as a test may look at it on a slow machine: the default 300 s
            # purged a fine-tuning job that had ended before its test looked (on an AVX2-only EPYC), and the test
            # waited out its whole timeout for a state Slurm had forgotten.
            "MinJobAge=7200",
            "MessageTimeout=20", "InactiveLimit=0",
            # As many clusters do: a task that exits non-zero ends its whole step at once (srun --kill-on-bad-exit),
            # so a job's rank 0 must have requeued it before any other rank exits.
            "KillOnBadExit=1",
            # `cpus` may exceed the machine's cores (jobs that mostly wait, run side by side): trust this file.
            "SlurmdParameters=config_overrides",
            f"NodeName={self.host} CPUs={self.cpus} RealMemory={memory} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
            ""]))

    # ---- daemons ----
    def start(self) -> "SlurmCluster":
        ensure_installed()
        self.write_config()
        os.environ["SLURM_CONF"] = str(self.conf)          # sbatch, squeue, scontrol and submitit read it
        self._start_munge()
        for daemon, pid_file in (("slurmctld", "slurmctld.pid"), ("slurmd", "slurmd.pid")):
            subprocess.run([daemon, "-f", str(self.conf)], check=True)
            self.started.append(self.root / pid_file)
        self.wait_for_idle_node()
        return self

    def _start_munge(self) -> None:
        if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0:
            return
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for folder in ("/etc/munge", "/run/munge", "/var/log/munge", "/var/lib/munge"):
            Path(folder).mkdir(parents=True, exist_ok=True)
            shutil.chown(folder, "munge", "munge")
        shutil.chown(key, "munge", "munge")
        subprocess.run(["runuser", "-u", "munge", "--", "munged", "--force"], check=True)
        self.started.append(Path("/run/munge/munged.pid"))

    def wait_for_idle_node(self, timeout_s: float = 60) -> None:
        timeout_s = scaled(timeout_s)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
            if state.returncode == 0 and state.stdout.strip() == "idle":
                return
            time.sleep(0.5)
        raise RuntimeError(f"the local Slurm node did not become idle in {timeout_s} s; see {self.root / 'log'}")

    def stop(self) -> None:
        """Cancel every job, then stop the daemons this object started (SIGTERM, then SIGKILL after 10 s)."""
        if self.started:
            jobs = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()
            if jobs:
                subprocess.run(["scancel", *jobs], capture_output=True)
                deadline = time.time() + scaled(30)
                while time.time() < deadline and \
                        subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.strip():
                    time.sleep(0.5)
        for pid_file in reversed(self.started):
            try:
                pid = int(pid_file.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            for _ in range(100):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, signal.SIGKILL)
        self.started = []
        os.environ.pop("SLURM_CONF", None)

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- what the tests ask ----
    def job_state(self, job_id: str) -> str:
        """The job's state as scontrol reports it (PENDING, RUNNING, COMPLETED, FAILED, ...)."""
        return scontrol_job(job_id)["JobState"]

    def restart_count(self, job_id: str) -> int:
        return int(scontrol_job(job_id).get("Restarts", 0))


def scontrol_job(job_id: str) -> dict[str, str]:
    """`scontrol show job`'s fields; an AssertionError naming the job when Slurm does not know it (never submitted,
    or its record purged after MinJobAge)."""
    shown = subprocess.run(["scontrol", "show", "job", str(job_id)], capture_output=True, text=True)
    fields = dict(field.split("=", 1) for field in shown.stdout.split() if "=" in field)
    assert "JobState" in fields, f"Slurm does not know job {job_id}: {(shown.stderr or shown.stdout).strip()}"
    return fields
