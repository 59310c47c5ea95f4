"""``python -m distaccum ARGS`` for the tests, forked from one server per pytest process instead of a new interpreter.

Most end-to-end tests run distaccum's command line, and a fresh ``python -m distaccum`` spends about 1.6 s of CPU
importing torch, Hydra and distaccum before its first line of work (the workers it starts then come from its own
worker server, :mod:`distaccum.cluster.forked`, which the launcher forks from itself). Here one server per pytest
process imports the command line and the Trainer once, and every command is a fork of it: the same code from
``distaccum/__main__.py`` on, the same process tree below the launcher, the same exit (the forked command leaves
through the interpreter's own shutdown: atexit handlers, thread joins).

What a forked command takes from the request, not from the server: its argv, working directory (also first on
``sys.path``, as ``python -m`` puts it), environment, standard output and error (pipes the test reads to EOF, as
``subprocess.run`` does, so a process left holding them still hangs the test), and stdin (``/dev/null``). What it
takes from the server: the modules already imported, which read some variables when imported. A request that
changes one of those (:data:`IMPORT_TIME_ENV`) runs as a new interpreter instead (:func:`run`).

The server is a single-threaded loop (it forks; a fork copies only the calling thread) that never computes (a fork
of a process that ran a parallel tensor op hangs in its first one): it imports, then accepts one request per
connection, forks the command, answers with its pid and, when it has reaped it, its exit code. It exits when the
pytest process that started it does. Commands forked from one server share its hash seed (``PYTHONHASHSEED``).
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from distaccum.cluster import forked

PRELOAD = [
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "hydra.utils",
    "distaccum.cli",
    "distaccum.cli.compose",
    "distaccum.cli.train",
    "distaccum.cli.verify",
    "distaccum.cli.worker",
    "distaccum.cluster.local",
    "distaccum.trainer",
    "distaccum.verify.runner",
    "torch._inductor.compile_fx",  # DeepSpeed's ZeRO optimizer check imports a module that calls torch.compile
    "transformers.models.auto.modeling_auto",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
    "datasets",
    "distaccum.hf",
]
"""What the server imports once (what ``distaccum train`` and ``verify`` import before their first line of work)."""

IMPORT_TIME_ENV = (
    "PYTHON",
    "TORCHINDUCTOR_",
    "TORCHDYNAMO_",
    "TORCH_COMPILE",
    "TORCH_LOGS",
    "OMP_SCHEDULE",
    "HF_",  # huggingface_hub, datasets and transformers read their offline switches and cache paths when imported
    "TRANSFORMERS_",
)
"""Prefixes of variables that the preloaded modules (or the interpreter) read when they start: a request that sets
one to another value than the server's runs as a new interpreter. Applied by the fork instead: ``PYTHONUNBUFFERED``
(line-buffered output), ``PYTHONPATH`` (its entries on ``sys.path``) and ``OMP_NUM_THREADS``."""
APPLIED = ("PYTHONUNBUFFERED", "PYTHONPATH")


def _changed(env: Mapping[str, str], base: Mapping[str, str]) -> set[str]:
    keys = set(env) | set(base)
    return {key for key in keys if env.get(key) != base.get(key)}


def import_time_changes(env: Mapping[str, str], base: Mapping[str, str]) -> list[str]:
    """The variables of ``env`` that differ from ``base`` and are read at import time (see :data:`IMPORT_TIME_ENV`)."""
    return sorted(
        key for key in _changed(env, base) if key.startswith(IMPORT_TIME_ENV) and key not in APPLIED
    )


# --- the server ---------------------------------------------------------------------------------------------------


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise EOFError("connection closed mid-request")
        data += chunk
    return data


def _command(request: dict, fds: list[int], server_sockets: list[socket.socket]) -> None:
    """In the forked child: become ``python -m distaccum ARGV`` as the request describes. Never returns to the
    server's loop: the module's SystemExit (or its exception) ends the interpreter as in a new process."""
    import runpy

    # the server's sockets, closed through their objects: no stale descriptor number left to close twice
    for sock in server_sockets:
        sock.close()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, target in zip(fds, (1, 2), strict=True):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    forked.apply_thread_env()  # OMP_NUM_THREADS, as a new interpreter reads it
    sys.path[0] = os.getcwd()  # python -m puts the working directory first, then PYTHONPATH's entries
    extra = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[1:1] = [p for p in extra if p not in sys.path]
    if os.environ.get("PYTHONUNBUFFERED"):
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    if request.get("kind") == "torchrun":
        _torchrun(request["argv"])
    else:
        sys.argv = ["distaccum", *request["argv"]]
        runpy.run_module("distaccum", run_name="__main__", alter_sys=True)
    raise SystemExit(0)


def _torchrun(argv: list[str]) -> None:
    """``python -m torch.distributed.run ARGV SCRIPT ARGS`` in this forked command: torch's own launcher (its
    arguments, rendezvous, restarts, failure report), whose ranks run ``SCRIPT`` as ``--run-path`` does, forked
    from a worker server forked from here (distaccum's, :mod:`distaccum.cluster.forked`) instead of each starting a
    new interpreter. A script that ends its rank itself calls :func:`distaccum.cluster.forked.leave`."""
    import cli_server as named  # this module by its name (not __main__), so that the ranks find rank_script
    import torch.distributed.run as torchrun

    args = torchrun.parse_args(argv)
    if args.module or args.no_python:
        raise SystemExit("the tests' forked torchrun runs a script (no -m, no --no-python)")
    sys.path[0] = os.path.dirname(os.path.abspath(args.training_script))  # as `python SCRIPT` puts it
    torchrun.run_script_path = named.rank_script  # this process's torchrun only
    forked.start()
    torchrun.main(["--run-path", "--start-method=forkserver", *argv])


def rank_script(training_script: str, *training_script_args: str) -> None:
    """A rank of :func:`_torchrun`: what a new interpreter would not inherit undone, then the script as ``__main__``."""
    import runpy

    forked.as_new_process()
    sys.argv = [training_script, *training_script_args]
    runpy.run_path(training_script, run_name="__main__")


def serve(address: str) -> None:
    """The server's loop (see the module docstring); ``address``: the Unix socket it listens on."""
    import importlib

    parent = os.getppid()
    # this module by its name too (the forked torchrun's ranks find their entry point in it)
    for name in [*PRELOAD, "cli_server"]:
        importlib.import_module(name)
    forked.freeze_heap()  # the commands' garbage collections skip (and so do not copy) what was imported here
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address + ".tmp")
    listener.listen(64)
    os.rename(address + ".tmp", address)  # clients connect once it listens
    waiting: dict[int, socket.socket] = {}
    # A finished command wakes the loop at once: SIGCHLD writes to a pipe the loop watches (as multiprocessing's
    # forkserver does); the one-second timeout only notices the pytest process gone.
    woken_r, woken_w = os.pipe()
    os.set_blocking(woken_r, False)
    os.set_blocking(woken_w, False)
    signal.set_wakeup_fd(woken_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    ready = selectors.DefaultSelector()
    ready.register(listener, selectors.EVENT_READ)
    ready.register(woken_r, selectors.EVENT_READ)
    while os.getppid() == parent:
        for key, _ in ready.select(timeout=1.0):
            if key.fd == woken_r:
                while True:
                    try:
                        if not os.read(woken_r, 4096):
                            break
                    except BlockingIOError:
                        break
                continue
            conn, _ = listener.accept()
            message, fds, _flags, _addr = socket.recv_fds(conn, 1, 2)
            request = json.loads(message + _read_line(conn))
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                ready.close()
                os.close(woken_r)
                os.close(woken_w)
                _command(request, fds, [listener, conn, *waiting.values()])
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid)
            try:
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass  # the test gave up on it (a timeout)
            conn.close()


# --- the client (in the pytest process) ---------------------------------------------------------------------------


class Server:
    """The pytest process's server, started on first use."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""
        self.env: dict[str, str] = {}

    def ensure(self) -> str:
        if self.proc is not None and self.proc.poll() is None:
            return self.address
        folder = tempfile.mkdtemp(prefix="distaccum-cli-")
        self.address = os.path.join(folder, "server")
        self.env = dict(os.environ)
        self.proc = subprocess.Popen([sys.executable, __file__, self.address], stdin=subprocess.DEVNULL)
        atexit.register(self.proc.kill)
        deadline = time.monotonic() + 120
        while not os.path.exists(self.address):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the test CLI server exited {self.proc.returncode} while importing")
            if time.monotonic() > deadline:
                raise RuntimeError("the test CLI server did not start in 120 s")
            time.sleep(0.02)
        return self.address


SERVER = Server()


def _decode(data: bytes) -> str:
    return data.decode("utf-8", "replace").replace("\r\n", "\n").replace("\r", "\n")


def run(
    argv: Sequence[str], *, cwd: Path | str, env: Mapping[str, str], timeout: float, torchrun: bool = False
) -> subprocess.CompletedProcess[str]:
    """``python -m distaccum ARGV`` (``python -m torch.distributed.run ARGV`` with ``torchrun``, its ranks forked too:
    see :func:`_torchrun`) as ``subprocess.run(..., capture_output=True, text=True, timeout=...)`` would run it,
    forked from this process's server (a new interpreter where the request changes an import-time variable).
    Raises :class:`subprocess.TimeoutExpired` after killing the command, as ``subprocess.run`` does."""
    command = [sys.executable, "-m", "torch.distributed.run" if torchrun else "distaccum", *argv]
    address = SERVER.ensure()
    if import_time_changes(env, SERVER.env):
        return subprocess.run(
            command, cwd=cwd, env=dict(env), capture_output=True, text=True, timeout=timeout
        )
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    conn = socket.socket(socket.AF_UNIX)
    try:
        conn.connect(address)
        request = {
            "kind": "torchrun" if torchrun else "distaccum",
            "argv": list(argv),
            "cwd": str(cwd),
            "env": dict(env),
        }
        socket.send_fds(conn, [b"{"], [out_w, err_w])
        conn.sendall(json.dumps(request)[1:].encode() + b"\n")
    finally:
        os.close(out_w)
        os.close(err_w)
    deadline = time.monotonic() + timeout
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    reply = b""
    sel = selectors.DefaultSelector()
    for fd in (out_r, err_r):
        sel.register(fd, selectors.EVENT_READ)
    sel.register(conn, selectors.EVENT_READ)
    open_fds = {out_r, err_r}
    pid = None
    try:
        while open_fds or reply.count(b"\n") < 2:
            left = deadline - time.monotonic()
            if left <= 0:
                if pid is not None:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                raise subprocess.TimeoutExpired(
                    command,
                    timeout,
                    output=_decode(b"".join(chunks[out_r])),
                    stderr=_decode(b"".join(chunks[err_r])),
                )
            for key, _ in sel.select(timeout=min(left, 1.0)):
                if key.fileobj is conn:
                    data = conn.recv(4096)
                    if not data:
                        sel.unregister(conn)
                        if reply.count(b"\n") < 2:
                            raise RuntimeError("the test CLI server closed the connection (did it exit?)")
                        continue
                    reply += data
                    if pid is None and b"\n" in reply:
                        pid = int(reply.split(b"\n", 1)[0])
                else:
                    fd = int(key.fd)
                    data = os.read(fd, 65536)
                    if data:
                        chunks[fd].append(data)
                    else:
                        sel.unregister(fd)
                        open_fds.discard(fd)
    finally:
        sel.close()
        conn.close()
        os.close(out_r)
        os.close(err_r)
    code = int(reply.split(b"\n")[1])
    return subprocess.CompletedProcess(
        command, code, _decode(b"".join(chunks[out_r])), _decode(b"".join(chunks[err_r]))
    )


if __name__ == "__main__":
    serve(sys.argv[1])
