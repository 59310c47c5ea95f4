"""Workers started from a process that has already loaded their libraries: ``python -m distaccum _worker CONFIG`` without
a fresh interpreter per worker.

A fresh worker spends about 2 s of CPU importing torch, its compiler stack (DDP's constructor and torch's optimizers
import ``torch._dynamo``), Hydra and the Trainer before it does anything; every worker of a launch pays it, and
every launch of a verify (its candidates) or a sweep pays it again. Here the launcher starts one *worker server*
(multiprocessing's forkserver) that imports :data:`PRELOAD` once, and torch elastic forks each worker from it: the
same environment contract, restarts and signals as a spawned worker.

Why a server rather than forking the launcher itself: the launcher is not a clean parent. Its pre-flight check
instantiated the user's components (a component with a process-wide side effect, such as a hook registered on
torch, would then act twice in a forked worker: seen here with the testing seam's gradient faults), verify ran its
reference in it (an OpenMP thread pool, which a forked child cannot use: its first parallel region waits forever),
and on a GPU machine it may hold a CUDA context (unusable after a fork). The server only imports: a worker forked
from it starts as clean as a new interpreter, on any device and any number of threads.

What a forked worker does not inherit from the launcher is passed to it: the environment at launch time (the server's
is the launcher's when it started; torch elastic adds each rank's variables) and the launcher's standard output and
error as they are then (verify sends each candidate's to its own console.log), applied by :func:`run_forked` before
``python -m distaccum ARGV`` runs in the worker. Only distaccum's command line starts a server (:func:`started`):
multiprocessing imports the launching process's main module again in every forked worker, which a user's own script
calling distaccum's launch in-process must not see; there, workers are spawned as before.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
from collections.abc import Mapping, Sequence
from multiprocessing import forkserver, reduction
from typing import Any

PRELOAD = [
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "hydra.utils",
    "distaccum.cli.worker",
    "distaccum.trainer",
]
"""What every worker imports before its first step: loaded once by the worker server, shared by the forked workers."""

_server_env: dict[str, str] | None = None
"""The environment the worker server started with (what a forked worker finds before :func:`run_forked` runs)."""


def available() -> bool:
    """Whether workers can be forked from a server here (POSIX with fd passing; not Windows)."""
    return "forkserver" in multiprocessing.get_all_start_methods()


def start(extra: Sequence[str] = ()) -> None:
    """Start the worker server now (idempotent), so that it imports while this process goes on with its own work;
    nothing where multiprocessing has no forkserver (Windows: workers are spawned). ``extra``: modules the run's
    workers import beyond :data:`PRELOAD` (its engine's :attr:`~distaccum.engines.base.EngineBase.worker_imports`)."""
    global _server_env
    if not available():
        return
    if _server_env is None:
        preload = [*PRELOAD, *(name for name in extra if name not in PRELOAD)]
        multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
        _server_env = dict(os.environ)
        logging.getLogger(ELASTIC_LOGGER).addFilter(_exit_without_traceback)
        if _fork_server(preload):
            return
    forkserver.ensure_running()


_FORKSERVER_STATE = ("_lock", "_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid")
"""What :func:`_fork_server` sets on multiprocessing's forkserver (CPython 3.10-3.13); one with an authentication key
(3.14's ``_forkserver_authkey``) or other state is started by multiprocessing itself."""


def _fork_server(preload: list[str]) -> bool:
    """Start multiprocessing's forkserver as a fork of this process instead of a new interpreter, so that it inherits
    what this process already imported (torch, Hydra, distaccum: about 1.6 s of CPU a command saves) and imports only
    the rest of ``preload``. Done exactly as :meth:`multiprocessing.forkserver.ForkServer.ensure_running` does it (a
    listening socket and an "alive" pipe handed to :func:`multiprocessing.forkserver.main`), except for the fork.

    Safe only from a clean parent, which the caller guarantees by calling :func:`start` before it runs anything but
    imports and config parsing (no tensor op, so no OpenMP pool; no CUDA; no component instantiated). Refused, and
    left to multiprocessing, where this process has another thread (a fork copies only the calling one) or the
    forkserver is not the one this was written for. The server is killed when this process exits (if it is still
    importing then, its import is wasted work)."""
    import atexit
    import signal
    import socket
    import threading
    from multiprocessing import connection, resource_tracker, util

    server: Any = forkserver._forkserver  # its private state, checked below
    if threading.active_count() > 1 or hasattr(server, "_forkserver_authkey"):
        return False
    if not all(hasattr(server, name) for name in _FORKSERVER_STATE) or server._forkserver_pid is not None:
        return False
    resource_tracker.ensure_running()  # inherited by the server, as multiprocessing's own start does
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # the server leaves when every holder of alive_w has exited
        for stream in (sys.stdout, sys.stderr):  # nothing buffered here is written twice
            stream.flush()
        pid = os.fork()
        if pid == 0:  # the server: it never returns to this process's code
            code = 0
            try:
                os.close(alive_w)
                for name in preload:  # as forkserver.main would, then frozen before the first worker's fork
                    try:
                        __import__(name)
                    except ImportError:
                        pass
                freeze_heap()
                forkserver.main(listener.fileno(), alive_r, [])
            except SystemExit:
                pass
            except BaseException:  # noqa: BLE001 - a server that failed to start: its clients see it gone
                import traceback

                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        os.close(alive_r)
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid

    def stop() -> None:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass

    atexit.register(stop)
    return True


def freeze_heap() -> None:
    """Move every object this process holds to the garbage collector's permanent generation (``gc.freeze``), right
    before it serves forks: a forked worker's collections then scan only what the worker itself allocated.

    Without it, every full collection in a worker (the Trainer runs one when it finishes, Accelerate's
    ``free_memory`` another) walks the whole inherited heap of torch, its compiler stack and the Trainer, and writes
    to each object's header as it goes, which copies the shared pages into the worker. The larger the server's heap
    and the more runs a worker process finishes, the more it costs: the test suite's command server
    (``tests/cli_server.py``, which does the same) halved the CPU time of its engine matrix with it. Python's
    documented pattern for a process that forks without exec (the ``gc.freeze`` docs)."""
    import gc

    gc.freeze()


ELASTIC_LOGGER = "torch.distributed.elastic.multiprocessing.api"


def _exit_without_traceback(record: logging.LogRecord) -> bool:
    """torch elastic logs a forked worker's non-zero exit with the traceback of its own polling (a spawned one's
    in one line): the line is kept (the launcher then names each failed rank), the traceback dropped."""
    if (
        record.exc_info
        and record.exc_info[0] is not None
        and record.exc_info[0].__name__ == "ProcessExitedException"
    ):
        record.exc_info = None
        record.exc_text = None
    return True


def started() -> bool:
    """Whether this process started a worker server (distaccum's command line does; a launch from a user's own
    process spawns its workers: a forked worker would re-import that process's main module, as multiprocessing does)."""
    return _server_env is not None


def worker_args(argv: list[str], env: Mapping[str, str] | None = None) -> tuple[Any, ...]:
    """The arguments of :func:`run_forked` for one launch, taken now: ``argv``, ``env`` (default: this process's
    environment), its server's, and its standard output and error (sent to each worker as file descriptors when it
    starts)."""
    assert _server_env is not None, "start() first"
    launch_env = dict(os.environ if env is None else env)
    return (argv, launch_env, _server_env, _Fd(sys.stdout.fileno()), _Fd(sys.stderr.fileno()))


class _Fd:
    """A file descriptor of the launcher, duplicated into the worker when multiprocessing pickles its arguments."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return (_received, (reduction.DupFd(self.fd),))


def _received(dup: Any) -> int:
    return int(dup.detach())


def worker_env(
    found: Mapping[str, str], launch_env: Mapping[str, str], server_env: Mapping[str, str]
) -> dict[str, str]:
    """A forked worker's environment: the launcher's at launch time, with the variables torch elastic set for this
    rank (what the worker ``found`` that the server did not start with) on top."""
    rank = {key: value for key, value in found.items() if server_env.get(key) != value}
    return {**launch_env, **rank}


def run_forked(
    argv: list[str], launch_env: Mapping[str, str], server_env: Mapping[str, str], out: int, err: int
) -> None:
    """A worker forked from the server: the launcher's environment and output applied, then ``python -m distaccum
    ARGV``. It returns (rather than ``os._exit``) when the rank succeeded: see :func:`leave`."""
    import runpy

    env = worker_env(os.environ, launch_env, server_env)
    os.environ.clear()
    os.environ.update(env)
    as_new_process()
    for fd, target in ((out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    for stream in (
        sys.stdout,
        sys.stderr,
    ):  # PYTHONUNBUFFERED reaches a new interpreter only: line by line here
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)
    sys.argv = ["distaccum", *argv]
    runpy.run_module("distaccum", run_name="__main__", alter_sys=True)


def as_new_process() -> None:
    """Undo in a forked worker what it inherited and a new interpreter would not have (its environment applied first):
    multiprocessing's start method and temporary folder, and the intra-op thread count (:func:`apply_thread_env`)."""
    # multiprocessing hands its start method down to what it starts: a rank's own processes (DataLoader workers) start
    # as in a rank started fresh (the platform's default), children of the rank that notice when it dies.
    multiprocessing.set_start_method(None, force=True)
    # ... and with a temporary folder of their own: multiprocessing copied the launcher's into this process (its
    # Process object's _config), which the launcher removes when it exits, before a DataLoader worker ends.
    multiprocessing.current_process()._config.pop("tempdir", None)  # type: ignore[attr-defined]
    apply_thread_env()


def apply_thread_env() -> None:
    """Give this process the intra-op threads a new interpreter would take from its environment: ``OMP_NUM_THREADS``,
    else one per CPU it may run on. The OpenMP runtime reads the variable once, when torch loads it, so a process forked
    from one that had imported torch keeps its parent's count whatever the launch set (2 ranks on 2 cores ran 2 threads
    each, where the launcher's ``OMP_NUM_THREADS=1`` meant one)."""
    import torch

    value = os.environ.get("OMP_NUM_THREADS", "")
    first = value.split(",")[0].strip()  # OpenMP allows a list (one count per nesting level)
    threads = int(first) if first.isdigit() and int(first) > 0 else len(os.sched_getaffinity(0))
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def leave(code: int) -> None:
    """End a worker process with ``code``, skipping interpreter shutdown (``os._exit``).

    A forked worker that succeeded returns instead, to torch elastic's wrapper, which hands its result to the launcher
    and then leaves through multiprocessing's exit (``os._exit`` too, after joining the process's own children): its
    children (DataLoader workers, which inherit the rank's SIGTERM handler and so outlive a terminate) are killed here
    first, as a rank's exit would leave them to die."""
    if code != 0 or multiprocessing.parent_process() is None:
        os._exit(code)
    for child in multiprocessing.active_children():
        child.kill()
        child.join()
