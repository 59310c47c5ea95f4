"""Slurm: render an sbatch script for a run, submit it, wait for it, expand nodelists.

:func:`render_sbatch` is pure (config in, script text out) and checked against golden files;
:func:`submit` and :func:`wait_job` are the thin executors, and the only code here that starts
processes. The rendered job runs one ``torch.distributed.run`` agent per node (``srun`` with one
task per node); the agents meet at a c10d rendezvous on the job's first node, and each starts
``--nproc_per_node`` workers that run ``distaccum train`` in place. Each node's ranks are consecutive,
so FSDP2 hybrid sharding with one replica per node (``engine.replicas=auto``) shards within a node and
replicates across nodes; the script's header shows that mapping.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import product
from pathlib import Path, PurePosixPath

from distaccum.cluster.base import JobLauncher, LaunchError, Submitted, World
from distaccum.cluster.config import SlurmConfig
from distaccum.config import RunConfig
from distaccum.engines import engine_class
from distaccum.outer.islands import island_lines, resolve_islands
from distaccum.runtime.topology import placement_lines, resolve_replicas

SCRIPT_NAME = "submit.sbatch"
"""File name of the rendered script inside ``run_dir``."""

# Signals the torchrun agent catches and forwards to its workers. SIGUSR1 is added to torch's
# default list: without a handler the agent would die from it (default action: terminate)
# instead of handing it to the workers, which checkpoint on it before the time limit.
AGENT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"

_UNSAFE_PATH = re.compile(r"[\s%]")


class SlurmError(LaunchError):
    """A Slurm command is missing or failed; the message says which and why."""


@dataclass(frozen=True)
class SubmitResult:
    """What :func:`submit` did."""

    script: str
    """The rendered sbatch script."""
    script_path: Path | None
    """Where it was written (``run_dir/submit.sbatch``); None on a dry run."""
    job_id: str | None
    """The Slurm job id; None on a dry run."""


def _directives(cfg: RunConfig) -> list[str]:
    slurm = cfg.slurm
    lines = [
        f"--job-name={slurm.job_name}",
        f"--nodes={slurm.nodes}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={cpus_per_task(cfg)}",
    ]
    if slurm.gpus_per_node > 0:
        lines.append(f"--gpus-per-node={slurm.gpus_per_node}")
    if slurm.partition:
        lines.append(f"--partition={slurm.partition}")
    if slurm.account:
        lines.append(f"--account={slurm.account}")
    lines += [
        f"--time={slurm.time}",
        f"--output={cfg.run_dir}/slurm-%j.out",
        f"--error={cfg.run_dir}/slurm-%j.err",
    ]
    if slurm.signal_seconds > 0:
        # USR1 ahead of the limit -> checkpoint at the window boundary -> requeue -> resume;
        # append so the requeued run's log follows the first one's.
        lines += [f"--signal=B:USR1@{slurm.signal_seconds}", "--requeue", "--open-mode=append"]
    lines += slurm.extra
    return [f"#SBATCH {line}" for line in lines]


def job_world_size(cfg: RunConfig) -> int:
    """Ranks of the rendered job: nodes x (GPUs per node, or trainer.nproc CPU workers)."""
    per_node = cfg.slurm.gpus_per_node if cfg.slurm.gpus_per_node > 0 else cfg.trainer.nproc
    return cfg.slurm.nodes * per_node


def layout_lines(cfg: RunConfig, nodes: int, per_node: int) -> list[str]:
    """The HSDP replicas or outer-sync islands of a job of ``nodes`` x ``per_node`` ranks, one consecutive block of
    ranks per node (one torchrun per node, as here and in a Kubeflow TrainJob): the lines a rendered job shows."""
    world = nodes * per_node
    replicas = resolve_replicas(
        cfg.engine.replicas, engine_class(cfg.engine.name).hybrid_sharding, world, nodes
    )
    islands = resolve_islands(cfg.outer.islands, world, nodes) if cfg.outer.enabled else 0
    if islands:
        replicas = 1  # the islands are the replicas (no HSDP inside one)
    return placement_lines(replicas, nodes, per_node) + island_lines(islands, nodes, per_node)


def split_line(cfg: RunConfig, nodes: int, per_node: int) -> str:
    """What a rendered job runs, for its header: nodes x workers = world, and the split of the global batch there."""
    world = nodes * per_node
    if cfg.accum.auto:
        split = (
            f"micro-batch auto (measured when training starts) x K = global batch {cfg.accum.global_batch}"
        )
    else:
        s = cfg.split(world)  # ValueError, with the valid splits, when there is none on this world
        split = (
            f"micro-batch {s.micro_batch} x K={s.accum_steps} x world {world} = global batch {s.global_batch}"
        )
    return f"{nodes} node(s) x {per_node} proc(s) = world {world}; {split}"


def cpus_per_task(cfg: RunConfig) -> int:
    """CPUs of each node's torchrun task: slurm.cpus_per_task, or slurm.cpus_per_gpu per GPU, or one per CPU worker."""
    slurm = cfg.slurm
    if slurm.cpus_per_task is not None:
        return slurm.cpus_per_task
    return slurm.cpus_per_gpu * slurm.gpus_per_node if slurm.gpus_per_node > 0 else cfg.trainer.nproc


def render_sbatch(cfg: RunConfig, overrides: Sequence[str], *, python: str = "python") -> str:
    """The sbatch script that runs ``distaccum train <overrides> run_dir=<cfg.run_dir>`` on Slurm.

    Pure and deterministic: the same arguments give the same text. ``overrides`` are the Hydra
    overrides the user gave (each is shell-quoted; a ``run_dir=`` among them is replaced by
    ``cfg.run_dir``); ``python`` is the interpreter on the nodes. Raises ValueError when
    ``cfg.run_dir`` cannot be used in an ``#SBATCH`` line.
    """
    if not cfg.run_dir or _UNSAFE_PATH.search(cfg.run_dir):
        raise ValueError(
            f"run_dir={cfg.run_dir!r} cannot be used for Slurm: it must be non-empty "
            "and hold no whitespace or '%' (sbatch reads '%' as a file-name pattern)"
        )
    slurm = cfg.slurm
    nproc = job_world_size(cfg) // slurm.nodes
    if cfg.ft.enabled:
        return render_ft_sbatch(cfg, overrides, python=python)
    train_args = [o for o in overrides if not o.startswith("run_dir=")] + [f"run_dir={cfg.run_dir}"]
    launch = [
        f"srun --kill-on-bad-exit=1 {shlex.quote(python)} -m torch.distributed.run",
        '--nnodes="$SLURM_NNODES"',
        f"--nproc_per_node={nproc}",
        f"--max_restarts={cfg.trainer.max_restarts}",
        "--rdzv_backend=c10d",
        f'--rdzv_endpoint="$head_node:{slurm.rdzv_port}"',
        '--rdzv_id="$SLURM_JOB_ID"',
        f"--signals_to_handle={AGENT_SIGNALS}",
        "-m distaccum train " + " ".join(shlex.quote(arg) for arg in train_args),
    ]
    lines = [
        "#!/bin/bash",
        "# Rendered by distaccum.cluster.slurm.render_sbatch; submit with `distaccum submit` or sbatch.",
        f"# {split_line(cfg, slurm.nodes, nproc)}",
        f"# Every node runs {python} (slurm.python): it must exist at this path on each of them.",
        *(f"# {line}" for line in layout_lines(cfg, slurm.nodes, nproc)),
        *_directives(cfg),
        "",
        "set -euo pipefail",
        "# Without it, elastic restarts often fail with 'Gloo connectFullMesh failed'.",
        "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        "",
        " \\\n    ".join(launch) + (" &" if slurm.signal_seconds > 0 else ""),
    ]
    if slurm.signal_seconds > 0:
        lines += [
            "srun_pid=$!",
            "# --signal=B:USR1 reaches only this shell: hand it to srun, which forwards it to the",
            "# agents, which forward it to the workers. `wait` returns early when the trap runs,",
            "# so wait again until srun has really exited, and exit with its status.",
            "stop_requested=0",
            """trap 'stop_requested=1; kill -USR1 "$srun_pid" 2>/dev/null || true' USR1""",
            "status=0",
            'wait "$srun_pid" || status=$?',
            'while kill -0 "$srun_pid" 2>/dev/null; do',
            "    status=0",
            '    wait "$srun_pid" || status=$?',
            "done",
            "# The workers finished their window and wrote a checkpoint: requeue, and the rerun of",
            "# this script resumes at the exact next sample (trainer.resume).",
            f'if [ "$stop_requested" = 1 ] && ls {shlex.quote(cfg.run_dir)}/checkpoints/step-*/manifest.json '
            ">/dev/null 2>&1; then",
            '    scontrol requeue "$SLURM_JOB_ID"',
            "    exit 0",
            "fi",
            'exit "$status"',
        ]
    return "\n".join(lines) + "\n"


LIGHTHOUSE_PORT = 29510
"""The port of a rendered job's torchft Lighthouse (torchft's default)."""


def ft_layout(cfg: RunConfig) -> tuple[int, int]:
    """(nodes of each replica group, groups on each node) of an ``ft.groups`` job: every group takes the same number
    of whole nodes (``slurm.nodes`` a multiple of ``ft.groups``), or the groups share nodes evenly (``ft.groups`` a
    multiple of ``slurm.nodes``, each group an equal share of a node's workers and GPUs); ValueError otherwise."""
    groups, nodes = cfg.ft.groups, cfg.slurm.nodes
    per_node = job_world_size(cfg) // nodes
    if nodes % groups == 0:
        return nodes // groups, 1
    shared = groups // nodes
    if groups % nodes == 0 and per_node % shared == 0:
        return 1, shared
    raise ValueError(
        f"ft.groups={groups} on slurm.nodes={nodes}: each replica group takes whole nodes, the same number (make "
        f"slurm.nodes a multiple of {groups}), or an equal share of one (ft.groups a multiple of slurm.nodes whose "
        f"groups per node divide the node's {per_node} worker(s))"
    )


def render_ft_sbatch(cfg: RunConfig, overrides: Sequence[str], *, python: str = "python") -> str:
    """The sbatch script of an ``ft.groups`` run: the torchft Lighthouse as a job step on the first node, then one
    job step per replica group on its own nodes, or its share of one (its own torchrun rendezvous,
    ``REPLICA_GROUP_ID``; groups sharing a node overlap there, each with its own GPUs), a group whose step fails
    started again up to ``ft.restarts`` times (it resumes its own checkpoints and heals from a live group), the job
    kept alive when a node is lost (``--no-kill``). Pure, as :func:`render_sbatch`."""
    slurm, ft = cfg.slurm, cfg.ft
    per_group, shared = ft_layout(cfg)
    nproc = job_world_size(cfg) // slurm.nodes // shared  # one group's workers on each of its nodes
    # torchft's console script of the workers' environment (installed beside their interpreter; a bare `python`
    # finds it on PATH)
    script = (
        str(PurePosixPath(python).with_name("torchft_lighthouse")) if "/" in python else "torchft_lighthouse"
    )
    lighthouse = (
        f"{shlex.quote(script)} '--bind=[::]:{LIGHTHOUSE_PORT}' --min_replicas={ft.min_groups} --join_timeout_ms="
        f"{ft.join_timeout_ms} --quorum_tick_ms={ft.quorum_tick_ms} --heartbeat_timeout_ms={ft.heartbeat_timeout_ms}"
    )
    args = " ".join(shlex.quote(o) for o in overrides if not o.startswith("run_dir="))
    groups_dir = shlex.quote(f"{cfg.run_dir}/groups")
    gpus = ',CUDA_VISIBLE_DEVICES="$devices"' if shared > 1 and slurm.gpus_per_node > 0 else ""
    launch = [
        f'srun --kill-on-bad-exit=1 --nodes={per_group} --ntasks={per_group} --relative="$first_index"'
        + (" --overlap" if shared > 1 else ""),
        f'--export=ALL,REPLICA_GROUP_ID="$g",DISTACCUM_FT_RESTART="$attempt",'
        f'TORCHFT_LIGHTHOUSE="http://$head_node:{LIGHTHOUSE_PORT}"{gpus}',
        f"{shlex.quote(python)} -m torch.distributed.run --nnodes={per_group} --nproc_per_node={nproc}",
        f'--rdzv_backend=c10d --rdzv_endpoint="$first:$(({slurm.rdzv_port} + g))" --rdzv_id="$SLURM_JOB_ID-$g"',
        f'-m distaccum train {args} run_dir="$dir"'.replace("  ", " "),
    ]
    where = (
        f"{per_group} node(s)"
        if shared == 1
        else f"1/{shared} of a node ({shared} groups per node, overlapping)"
    )
    lines = [
        "#!/bin/bash",
        "# Rendered by distaccum.cluster.slurm.render_ft_sbatch; submit with `distaccum submit` or sbatch.",
        f"# ft.groups={ft.groups} replica groups of {where} x {nproc} proc(s), a torchft Lighthouse on the "
        f"first node (min_replicas={ft.min_groups}, heartbeat_timeout_ms={ft.heartbeat_timeout_ms}).",
        f"# {split_line(cfg, per_group, nproc)} per group while every group is present; K grows when one is missing.",
        f"# A group's failed step is started again up to ft.restarts={ft.restarts} time(s): it resumes its own",
        "# checkpoints and heals from a live group. A lost node's group cannot restart in this job (the others go on).",
        "# slurm.signal_seconds is not used: stop the job with scancel; rerun, and each group resumes its checkpoints.",
        *(d for d in _directives(cfg) if not d.startswith(("#SBATCH --signal", "#SBATCH --requeue"))),
        "#SBATCH --no-kill",
        "",
        "set -uo pipefail",
        "export RUST_LOG=${RUST_LOG:-warn}  # torchft's Rust side (Lighthouse, managers): warnings only in the job's log",
        'nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
        'head_node="${nodes[0]}"',
        f"srun --nodes=1 --ntasks=1 --relative=0 --overlap {lighthouse} &",
        "lighthouse=$!",
        "run_group() {  # group $1 on its nodes, restarted when its step fails",
        f"    local g=$1 first_index=$(($1 / {shared} * {per_group})) attempt=0",
        '    local first="${nodes[$first_index]}"',
        *(
            [
                f"    local devices=$(seq -s, $(($1 % {shared} * {nproc})) $(($1 % {shared} * {nproc} + {nproc - 1})))"
            ]
            if gpus
            else []
        ),
        "    while true; do  # each attempt its own run directory, g<i>-a<attempt>, the first's checkpoints shared",
        f'        local dir={groups_dir}/g"$g"-a"$attempt"',
        '        mkdir -p "$dir"',
        '        if [ "$attempt" -gt 0 ]; then',
        f'            mkdir -p {groups_dir}/g"$g"-a0/checkpoints && ln -sfn ../g"$g"-a0/checkpoints "$dir/checkpoints"',
        "        fi",
        "        " + " \\\n            ".join(launch) + " && return 0",
        "        attempt=$((attempt + 1))",
        f'        if [ "$attempt" -gt {ft.restarts} ]; then echo "replica group $g: no restart left" >&2; return 1; fi',
        '        echo "replica group $g failed: restart $attempt (it resumes its checkpoints, heals from a live group)" >&2',
        "    done",
        "}",
        "pids=()",
        f'for g in $(seq 0 {ft.groups - 1}); do run_group "$g" & pids+=($!); done',
        "status=0",
        'for pid in "${pids[@]}"; do wait "$pid" || status=1; done',
        'kill "$lighthouse" 2>/dev/null || true',
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


def submit(
    cfg: RunConfig, overrides: Sequence[str], *, dry_run: bool = False, python: str = sys.executable
) -> SubmitResult:
    """Render the script, write it to ``run_dir/submit.sbatch`` and ``sbatch`` it.

    ``python`` defaults to this interpreter, so the job uses the submitter's environment (nodes
    share the file system on a typical cluster). With ``dry_run`` nothing is written or run: the
    result only carries the script. Raises :class:`SlurmError` when ``sbatch`` is not on PATH or
    refuses the job.
    """
    script = render_sbatch(cfg, overrides, python=cfg.slurm.python or python)
    if dry_run:
        return SubmitResult(script=script, script_path=None, job_id=None)
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise SlurmError(
            "sbatch not found on PATH: run `distaccum submit` on a Slurm login node, "
            "or use --dry-run to only print the script"
        )
    run_dir = Path(cfg.run_dir)
    # Slurm opens --output/--error before the job starts; a missing directory fails the job.
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / SCRIPT_NAME
    path.write_text(script)
    proc = subprocess.run([sbatch, "--parsable", str(path)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SlurmError(f"sbatch {path} failed (exit {proc.returncode}): {proc.stderr.strip()}")
    # --parsable prints "jobid" or "jobid;cluster".
    job_id = proc.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise SlurmError(f"sbatch printed no job id: {proc.stdout!r}")
    return SubmitResult(script=script, script_path=path, job_id=job_id)


def job_state(job_id: str, *, env: Mapping[str, str] | None = None) -> str:
    """The job's state (COMPLETED, FAILED, RUNNING, ...) from slurmctld, else accounting.

    slurmctld forgets a finished job after MinJobAge (300 s by default); ``sacct`` then answers
    where accounting is enabled. Returns ``UNKNOWN`` when neither knows the job.
    """
    proc = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, env=env, check=False
    )
    match = re.search(r"\bJobState=(\S+)", proc.stdout)
    if proc.returncode == 0 and match:
        return match.group(1)
    proc = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-o", "State", "-j", job_id],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    states = proc.stdout.split()
    # sacct prints "CANCELLED by 0"; keep the state word.
    return states[0] if proc.returncode == 0 and states else "UNKNOWN"


def wait_job(
    job_id: str,
    *,
    timeout_s: float | None = None,
    poll_s: float = 0.5,
    pending_timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
) -> str:
    """Block until the job has left the queue; return its final state (see :func:`job_state`).

    Polls ``squeue -h -j ID``, which shows pending, running and completing jobs only: it returns
    seconds after the job ends, where ``sbatch --wait`` returns ~30 s late. Raises TimeoutError
    after ``timeout_s``, and :class:`SlurmError` with Slurm's pending reason when the job is still
    pending after ``pending_timeout_s`` (a job asking for more than the cluster has waits forever)
    or when ``squeue`` fails for another reason.
    """
    start = time.monotonic()
    deadline = None if timeout_s is None else start + timeout_s
    while True:
        proc = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%T|%r"],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        if proc.returncode != 0 and "Invalid job id" not in proc.stderr:
            raise SlurmError(f"squeue -j {job_id} failed (exit {proc.returncode}): {proc.stderr.strip()}")
        if not proc.stdout.strip():  # gone from the queue (or already purged: "Invalid job id")
            return job_state(job_id, env=env)
        state, _, reason = proc.stdout.strip().splitlines()[0].partition("|")
        waited = time.monotonic() - start
        if state == "PENDING" and pending_timeout_s is not None and waited > pending_timeout_s:
            raise SlurmError(
                f"Slurm job {job_id} is still pending after {waited:.0f} s: reason {reason!r} "
                "(see `scontrol show job` and `sinfo`)"
            )
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"Slurm job {job_id} still {state} ({reason}) after {timeout_s} s")
        time.sleep(poll_s)


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets: 'a[1,2],b' -> ['a[1,2]', 'b']."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' in Slurm nodelist {text!r}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in Slurm nodelist {text!r}")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in Slurm nodelist {text!r}")
    parts.append(text[start:])
    return parts


def _expand_ranges(body: str, nodelist: str) -> list[str]:
    """'01-03,07' -> ['01', '02', '03', '07'], zero-padded to the width of each range's start."""
    out: list[str] = []
    for item in body.split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {item!r} in Slurm nodelist {nodelist!r}")
        end = int(hi) if sep else int(lo)
        if end < int(lo):
            raise ValueError(f"descending range {item!r} in Slurm nodelist {nodelist!r}")
        out += [str(n).zfill(len(lo)) for n in range(int(lo), end + 1)]
    return out


def parse_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm nodelist into host names, in the order of ``scontrol show hostnames``.

    ``"node[01-03,07],gpu5"`` gives ``["node01", "node02", "node03", "node07", "gpu5"]``;
    several bracket groups in one name multiply (``"r[1-2]-n[1-2]"`` gives 4 names). An empty
    string gives ``[]``. Raises ValueError on malformed input.
    """
    hosts: list[str] = []
    for part in _split_top_level(nodelist.strip()):
        if not part:
            if nodelist.strip():
                raise ValueError(f"empty name in Slurm nodelist {nodelist!r}")
            continue
        # "r[1-2]-n[3]" -> literal pieces and range pieces, alternating: ['r', '1-2', '-n', '3', ''].
        pieces = re.split(r"\[([^\]]*)\]", part)
        choices = [[p] if i % 2 == 0 else _expand_ranges(p, nodelist) for i, p in enumerate(pieces)]
        hosts += ["".join(combo) for combo in product(*choices)]
    return hosts


def _pinned(overrides: Sequence[str]) -> list[str]:
    """The overrides the job's workers compose again: ``run_dir`` is pinned to the submitter's resolved value."""
    return [o for o in overrides if not o.startswith("run_dir=")]


class SlurmLauncher(JobLauncher):
    """``distaccum submit --to slurm`` (the default): an sbatch script, ``sbatch``-ed."""

    name = "slurm"
    summary = "Slurm: an sbatch script, submitted with sbatch"
    section = ("slurm", SlurmConfig)
    world_size = staticmethod(job_world_size)

    @classmethod
    def world(cls, cfg: RunConfig) -> World:
        if cfg.ft.enabled:  # each replica group is its own world (the pre-flight checks its split)
            return World(job_world_size(cfg) // cfg.ft.groups, ft_layout(cfg)[0])
        return super().world(cfg)

    @staticmethod
    def render(cfg: RunConfig, overrides: Sequence[str]) -> str:
        return render_sbatch(cfg, _pinned(overrides), python=cfg.slurm.python or sys.executable)

    @staticmethod
    def submit(cfg: RunConfig, overrides: Sequence[str]) -> Submitted:
        result = submit(cfg, _pinned(overrides))
        return Submitted(str(result.job_id), f"wrote {result.script_path}; outputs go to {cfg.run_dir}")
