"""A private MPS server for ranks that share a GPU (tide-bench fsdp --mps).

Ranks sharing one GPU as plain processes time-slice it: a rank waiting for a peer's signal can wait
for the peer's time slice, which separate GPUs never do, so the exposed communication one GPU
measures is partly the emulation's. Under an MPS server their kernels run side by side, as on
separate GPUs. The server is this run's own: its pipe and log folders are in a temporary folder
(the GPU's compute mode and any other MPS server are left as they are), it is started before the
ranks and told to quit after them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import tempfile

CONTROL = "nvidia-cuda-mps-control"
ENV = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")


@dataclasses.dataclass
class MpsState:
    """What --mps did: `used` once the ranks ran as the server's clients; else `why` not."""
    requested: bool
    used: bool = False
    why: str = ""
    server_pid: int | None = None

    def describe(self) -> str:
        if not self.requested:
            return "ranks sharing a GPU time-slice it (no --mps)"
        if self.used:
            return "ranks ran under a private MPS server" + (f" (pid {self.server_pid})" if self.server_pid else "")
        return f"--mps: no MPS server: {self.why}; ranks sharing a GPU time-slice it"


def _control(command: str, env: dict, timeout: float = 30) -> str | None:
    """What the daemon answers `command`; None when it did not answer within `timeout` s."""
    try:
        return subprocess.run([CONTROL], input=command + "\n", env=env, capture_output=True, text=True,
                              timeout=timeout).stdout
    except subprocess.TimeoutExpired:
        return None


def _stop(env: dict) -> None:
    """Tells the daemon to quit; one that does not answer is ended through its pid file."""
    if _control("quit", env) is not None:
        return
    pid_file = os.path.join(env["CUDA_MPS_PIPE_DIRECTORY"], "nvidia-cuda-mps-control.pid")
    with contextlib.suppress(OSError, ValueError):
        os.kill(int(open(pid_file).read().strip()), signal.SIGTERM)


@contextlib.contextmanager
def private_server(state: MpsState):
    """Ranks spawned inside are the clients of an MPS server of their own, where one can start;
    `state` says afterwards whether they were, and why not."""
    if not state.requested:
        yield state
        return
    control = shutil.which(CONTROL)
    if control is None:
        state.why = f"{CONTROL} is not on PATH (it comes with the NVIDIA driver)"
        yield state
        return
    if any(os.environ.get(k) for k in ENV):
        state.why = f"{' or '.join(ENV)} is set: an MPS server of the environment's serves these ranks"
        yield state
        return
    folder = tempfile.mkdtemp(prefix="tide-mps-")
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=os.path.join(folder, "pipe"),
               CUDA_MPS_LOG_DIRECTORY=os.path.join(folder, "log"))
    os.makedirs(env["CUDA_MPS_PIPE_DIRECTORY"])
    os.makedirs(env["CUDA_MPS_LOG_DIRECTORY"])
    try:
        # The daemon's output to a file: a pipe would stay open in the daemon it forks.
        out_path = os.path.join(env["CUDA_MPS_LOG_DIRECTORY"], "start.out")
        with open(out_path, "w") as out:
            try:
                code = subprocess.run([control, "-d"], env=env, stdout=out, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, timeout=30).returncode
            except subprocess.TimeoutExpired:
                code = "timed out after 30 s"
        if code != 0:
            state.why = f"{CONTROL} -d exited {code}: {open(out_path).read().strip()}"
            yield state
            return
        saved = {k: os.environ.get(k) for k in ENV}
        os.environ.update({k: env[k] for k in ENV})  # inherited by the ranks spawned from here
        try:
            yield state
            # Whether the ranks were its clients: the daemon lists the server it started for them
            # (until told to quit) and logs each client it took.
            servers = (_control("get_server_list", env) or "").split()
            path = os.path.join(env["CUDA_MPS_LOG_DIRECTORY"], "control.log")
            log = open(path).read() if os.path.exists(path) else ""
            if (servers and servers[0].isdigit()) or "new client" in log.lower():
                state.used = True
                state.server_pid = int(servers[0]) if servers and servers[0].isdigit() else None
            else:
                state.why = f"no rank reached the server (its control log: {log[-300:].strip() or 'empty'})"
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            _stop(env)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
