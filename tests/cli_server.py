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
import select
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any

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
    if request.get("session"):
        os.setsid()  # as Popen(start_new_session=True)
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
    elif request.get("kind") == "script":  # python SCRIPT ARGS
        import runpy

        sys.argv = list(request["argv"])
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
        runpy.run_path(sys.argv[0], run_name="__main__")
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


KINDS = {"distaccum": ["-m", "distaccum"], "torchrun": ["-m", "torch.distributed.run"], "script": []}
"""What a request runs: ``python -m distaccum ARGV``, ``python -m torch.distributed.run ARGV`` (its ranks forked too:
see :func:`_torchrun`) or ``python ARGV`` (a script and its arguments)."""


@dataclass(frozen=True)
class Start:
    """What :func:`popen` starts and how: the command of ``kind`` (:data:`KINDS`) with ``ARGV`` in
    ``cwd`` with ``env``. ``stdout`` and ``stderr``: ``subprocess.PIPE``, an open file, or None (this process's own);
    ``stderr`` also ``subprocess.STDOUT``. ``new_session``: the command leads its own session and process group
    (``setsid``), as ``Popen(start_new_session=True)`` (a test may kill the group)."""

    argv: Sequence[str]
    _: KW_ONLY
    cwd: Path | str
    env: Mapping[str, str]
    stdout: Any = None
    stderr: Any = None
    kind: str = "distaccum"
    new_session: bool = False

    @property
    def command(self) -> list[str]:
        """The command line it stands for (and runs as, in a new interpreter)."""
        return [sys.executable, *KINDS[self.kind], *self.argv]


class Forked:
    """A command forked from this process's server, driven as a :class:`subprocess.Popen` is: ``pid``, ``returncode``,
    :meth:`poll`, :meth:`wait`, :meth:`send_signal`, :meth:`kill` and :meth:`communicate` (text), as :class:`Start`
    says. The pid is the server's child, not this process's: the exit status comes from the server, which reaps
    it."""

    def __init__(self, start: Start) -> None:
        self.args = start.command
        self.returncode: int | None = None
        self._pipes: dict[str, int] = {}  # "stdout"/"stderr" -> the read end this process keeps
        sent: list[int] = []  # the command's stdout and stderr descriptors
        for name, target in (("stdout", start.stdout), ("stderr", start.stderr)):
            if target == subprocess.PIPE:
                read, write = os.pipe()
                self._pipes[name] = read
                sent.append(write)
            elif target == subprocess.STDOUT:
                sent.append(os.dup(sent[0]))
            else:
                sent.append(os.dup(target.fileno() if target is not None else (1 if name == "stdout" else 2)))
        request = {
            "kind": start.kind,
            "argv": list(start.argv),
            "cwd": str(start.cwd),
            "env": dict(start.env),
            "session": start.new_session,
        }
        self._conn = socket.socket(socket.AF_UNIX)
        try:
            self._conn.connect(SERVER.ensure())
            socket.send_fds(self._conn, [b"{"], sent)
            self._conn.sendall(json.dumps(request)[1:].encode() + b"\n")
        finally:
            for fd in sent:
                os.close(fd)
        self._reply = b""
        while b"\n" not in self._reply:
            self._receive(None)
        self.pid = int(self._reply.split(b"\n", 1)[0])

    def _receive(self, timeout: float | None) -> None:
        """Read what the server says within ``timeout`` s (None: until it says something)."""
        if not select.select([self._conn], [], [], timeout)[0]:
            return
        data = self._conn.recv(4096)
        if not data:
            if self._reply.count(b"\n") < 2:
                raise RuntimeError("the test CLI server closed the connection (did it exit?)")
            return
        self._reply += data
        if self._reply.count(b"\n") >= 2 and self.returncode is None:
            self.returncode = int(self._reply.split(b"\n")[1])
            self._conn.close()

    def poll(self) -> int | None:
        if self.returncode is None:
            self._receive(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._receive(left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        """Read the piped outputs to their end and wait for the exit, as ``Popen.communicate`` (text); on a timeout
        :class:`subprocess.TimeoutExpired` carries what was read so far, and a later call goes on from there."""
        deadline = None if timeout is None else time.monotonic() + timeout
        chunks = getattr(self, "_chunks", None) or {name: [] for name in self._pipes}
        self._chunks = chunks
        fds = {fd: name for name, fd in self._pipes.items() if fd >= 0}
        while fds or self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(
                    self.args,
                    timeout or 0,
                    output=_decode(b"".join(chunks.get("stdout", []))),
                    stderr=_decode(b"".join(chunks.get("stderr", []))),
                )
            watched = [*fds, *([self._conn] if self.returncode is None else [])]
            ready = select.select(watched, [], [], None if left is None else min(left, 1.0))[0]
            for item in ready:
                if item is self._conn:
                    self._receive(0)
                    continue
                data = os.read(item, 65536)
                if data:
                    chunks[fds[item]].append(data)
                else:
                    os.close(item)
                    self._pipes[fds.pop(item)] = -1
        out, err = (
            _decode(b"".join(chunks[name])) if name in chunks else None for name in ("stdout", "stderr")
        )
        return out, err


Started = Forked | subprocess.Popen[str]
"""What :func:`popen` returns: either drives like a ``subprocess.Popen``."""


def popen(argv: Sequence[str], **options: Any) -> Started:
    """``python -m distaccum ARGV`` started in the background (see :class:`Forked`), or a new interpreter where the
    request changes an import-time variable. ``options``: :class:`Start`'s (``cwd`` and ``env`` required)."""
    start = Start(argv, **options)
    SERVER.ensure()
    if import_time_changes(start.env, SERVER.env):
        return subprocess.Popen(
            start.command,
            cwd=start.cwd,
            env=dict(start.env),
            stdout=start.stdout,
            stderr=start.stderr,
            text=True,
            start_new_session=start.new_session,
        )
    return Forked(start)


def run(
    argv: Sequence[str], *, cwd: Path | str, env: Mapping[str, str], timeout: float, kind: str = "distaccum"
) -> subprocess.CompletedProcess[str]:
    """The command of ``kind`` (:data:`KINDS`; ``python -m distaccum ARGV`` by default) as ``subprocess.run(...,
    capture_output=True, text=True, timeout=...)`` would run it, forked from this process's server (a new interpreter
    where the request changes an import-time variable).
    Raises :class:`subprocess.TimeoutExpired` after killing the command, as ``subprocess.run`` does."""
    proc = popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, kind=kind)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(proc.args, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(proc.args, proc.wait(), out, err)


if __name__ == "__main__":
    serve(sys.argv[1])
