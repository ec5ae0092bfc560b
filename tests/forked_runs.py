"""The project's command lines (`python -m pretrain`, `python -m eval`, ...) run in processes forked from a server
that imported torch, DeepSpeed, timm and FFCV once, so that a test's run starts in a second instead of the
10-15 s a new interpreter spends importing them.

    result = run("pretrain", ["--config", CONFIG, "run_dir=..."], expect=0)      # like subprocess.run
    process = start("pretrain", [...]); process.send_signal(signal.SIGTERM); process.wait(60)
    group = start("pretrain", [...], processes=2)        # as `torchrun --standalone --nproc-per-node 2 -m pretrain`

Each run is a process of its own (multiprocessing's forkserver: the server only imported modules, it never
ran a thread pool, so forking it is safe), with this test process's environment and working directory at the
time of the call, its stdout and stderr captured in files (in one temporary folder per test session, removed when
the session ends); it executes the module's `main(argv)` exactly as
`python -m MODULE ARGV` does and exits with its status. Several processes of one run (`processes=N`, a
`ForkedGroup`) are forked the same way, each given the variables `torchrun --standalone` gives its workers: a
two-process digits run of 6 steps took 7 s so, against 22 s under torchrun, whose workers import everything anew (2
cores of an AMD EPYC with AVX-512 that a training run shared, 2026-11-29); their losses were equal to the last bit. Runs that need a fresh interpreter on
purpose still use subprocess.
"""
from __future__ import annotations

import atexit
import gc
import importlib
import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.machine_speed import scaled

# `python -m NAME` -> the module whose main(argv) it runs
MODULES = {"pretrain": "pretrain.__main__", "eval": "eval.__main__", "transfer": "transfer.__main__",
           "launch": "launch.__main__", "pretrain.bench": "pretrain.bench", "pretrain.data": "pretrain.data.__main__",
           # the tests' own multi-process workers
           **{f"tests.{name}": f"tests.{name}" for name in ("test_distributed_equality", "test_dino_runs", "test_smoco",
                                                     "test_engine_step", "test_gradient_edits", "test_online_monitors")}}


# `torchrun --standalone --nproc-per-node N -m MODULE ARGV` as the tests write it (N follows)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]


def project_command(command: list[str]) -> tuple[str, list[str], int] | None:
    """(module, argv, processes) of a plain `python -m MODULE ARGV` command of this project (1 process), or of
    `python -m torch.distributed.run --standalone --nproc-per-node N -m MODULE ARGV` (N); else None."""
    command = [str(part) for part in command]
    if len(command) >= 3 and command[:2] == [sys.executable, "-m"] and command[2] in MODULES:
        return command[2], command[3:], 1
    if len(command) >= 8 and command[:5] == TORCHRUN and command[6] == "-m" and command[7] in MODULES:
        return command[7], command[8:], int(command[5])
    return None


_context = None
_output_root: str | None = None     # the session's folder of captured outputs


def output_folder() -> str:
    """A new folder for one run's stdout and stderr, inside the session's folder (removed at exit)."""
    global _output_root
    if _output_root is None:
        _output_root = tempfile.mkdtemp(prefix="forked_runs_")
        atexit.register(shutil.rmtree, _output_root, ignore_errors=True)
    return tempfile.mkdtemp(dir=_output_root)


def context():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        # deepspeed...muon_optimizer: DeepSpeed imports it at the first ZeRO engine (is_zero_supported_optimizer), and
        # its torch.compile decorators import torch._inductor: 2.7 s of each ZeRO run on an AVX2-only EPYC.
        _context.set_forkserver_preload(["pretrain.pretraining", "pretrain.__main__", "pretrain.data.ffcv_loader",
                                         "eval.__main__", "pretrain.methods.simclr", "transfer.finetune.stage",
                                         "deepspeed.runtime.zero.muon.muon_optimizer"])
    return _context


def _main(module: str, argv: list[str], env: dict, cwd: str, stdout: str, stderr: str) -> None:
    # The modules the server imported are out of the garbage collector's scans (as in start_worker of
    # tests/engine_helpers.py): DeepSpeed's explicit collections and the automatic full ones each scanned their
    # 400,000 objects, 0.3 s apiece on an AVX2-only EPYC.
    gc.freeze()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    # a forkserver child inherits "forkserver" as its default start method; a new interpreter has the
    # platform's default (FFCV's writer starts its workers with it and hands them unpicklable closures)
    multiprocessing.set_start_method(None, force=True)
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [f"python -m {module}", *argv]
    try:
        status = importlib.import_module(MODULES[module]).main(argv)
    except SystemExit as exit:
        status = exit.code if isinstance(exit.code, int) else 1
    except BaseException:
        import traceback
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status or 0)


class ForkedRun:
    """A started run: `pid`, `poll()`, `wait(timeout)`, `send_signal(signum)`, then `returncode`, `stdout`,
    `stderr` (text)."""

    def __init__(self, module: str, argv: list[str], env: dict | None = None):
        self.module = module
        self.folder = output_folder()
        self.stdout_path, self.stderr_path = f"{self.folder}/stdout", f"{self.folder}/stderr"
        self.process = context().Process(target=_main, args=(module, [str(a) for a in argv],
                                                             {**os.environ, **(env or {})}, os.getcwd(),
                                                             self.stdout_path, self.stderr_path))
        self.process.start()
        self.pid = self.process.pid

    @property
    def returncode(self) -> int | None:
        code = self.process.exitcode
        return None if code is None else (128 - code if code < 0 else code)   # -N (killed by N) -> 128 + N

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float) -> int:
        """Wait for the run's end, at most `timeout` s (as subprocess.Popen.wait; the tests pass
        tests.machine_speed.scaled(seconds)); subprocess.TimeoutExpired names the run when it has not ended."""
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(f"forked run {self.pid} of python -m {self.module}", timeout)
        return self.returncode

    @property
    def pids(self) -> list[int]:
        return [self.pid]

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def read(self, which: str) -> str:
        path = Path(self.stdout_path if which == "stdout" else self.stderr_path)
        return path.read_text(errors="replace") if path.exists() else ""

    @property
    def stdout(self) -> str:
        return self.read("stdout")

    @property
    def stderr(self) -> str:
        return self.read("stderr")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ForkedGroup:
    """The `processes` ranks of one run, each a ForkedRun with the variables `torchrun --standalone` gives its
    workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free port, and
    OMP_NUM_THREADS=1 unless it is set). The same interface as ForkedRun: `pids` (rank 0's is `pid`), `poll()`,
    `wait(timeout)`, `send_signal(signum)` to every rank, then `returncode` (as torchrun's: 1 when a rank failed, else 0) and
    `stdout` / `stderr` (the ranks' in rank order). As under torchrun, when a rank fails the others are given
    FAILURE_GRACE_S to end on their own (the project ends every rank with the message), then killed."""

    FAILURE_GRACE_S = 10

    def __init__(self, module: str, argv: list[str], env: dict | None, processes: int):
        port = str(free_port())
        self.module = module
        self.ranks = [ForkedRun(module, argv, {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {}),
                                               "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(processes),
                                               "LOCAL_WORLD_SIZE": str(processes), "MASTER_ADDR": "127.0.0.1",
                                               "MASTER_PORT": port})
                      for rank in range(processes)]
        self.pid = self.ranks[0].pid
        self.failed_at: float | None = None

    @property
    def pids(self) -> list[int]:
        return [rank.pid for rank in self.ranks]

    @property
    def returncode(self) -> int | None:
        codes = [rank.returncode for rank in self.ranks]
        if None in codes:
            return None
        return 1 if any(codes) else 0

    def poll(self) -> int | None:
        codes = [rank.returncode for rank in self.ranks]
        if None in codes and any(code not in (None, 0) for code in codes):
            self.failed_at = self.failed_at or time.monotonic()
            if time.monotonic() - self.failed_at > self.FAILURE_GRACE_S:
                self.send_signal(signal.SIGKILL)
        return self.returncode

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked group {self.pids} of python -m {self.module}", timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        for rank in self.ranks:
            if rank.returncode is None:
                try:
                    rank.send_signal(signum)
                except ProcessLookupError:
                    pass

    @property
    def stdout(self) -> str:
        return "".join(rank.stdout for rank in self.ranks)

    @property
    def stderr(self) -> str:
        return "".join(rank.stderr for rank in self.ranks)


def start(module: str, argv: list, env: dict | None = None, processes: int = 1) -> ForkedRun | ForkedGroup:
    return ForkedRun(module, argv, env) if processes == 1 else ForkedGroup(module, argv, env, processes)


def run(module: str, argv: list, expect: int | None = 0, timeout: float = 300, env: dict | None = None,
        processes: int = 1) -> ForkedRun | ForkedGroup:
    """Run `python -m MODULE ARGV` (on `processes` ranks) to completion; assert its exit status is `expect` (None:
    any). `timeout`: seconds on the reference CPU (tests/machine_speed.py)."""
    process = start(module, argv, env, processes)
    try:
        process.wait(scaled(timeout))
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGKILL)
        process.wait(10)
        raise AssertionError(f"python -m {module} (pid {process.pid}) timed out after {scaled(timeout):.0f} s: "
                             f"{process.stderr[-3000:]}")
    if expect is not None:
        assert process.returncode == expect, process.stderr[-3000:]
    return process


def run_rank_workers(module: str, out_dir: Path, processes: int = 2, timeout: float = 300) -> list[dict]:
    """A test's own worker `python -m MODULE OUT_DIR` on `processes` ranks (as torchrun's workers), each rank
    writing what it measured with `write_rank_results`; their dicts, in rank order."""
    run(module, [str(out_dir)], timeout=timeout, processes=processes)
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(processes)]


def write_rank_results(out_dir: Path, rank: int, results: dict) -> None:
    """A worker rank's measurements, for `run_rank_workers` to read back."""
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
