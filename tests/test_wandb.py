"""wandb offline on a real 2-rank run: files under run_dir, nothing in $HOME, no network, no key leak.

The run goes into a fresh network namespace (``unshare -n`` with only loopback up), so any attempt
to reach the wandb servers would fail the run instead of passing unnoticed. Where the machine
refuses the namespace the run goes ahead with a warning, except under ``CI=true``, where that is a
failure. wandb has no public reader for its ``.wandb`` file; :func:`wandb_records` reads its
framing (LevelDB log blocks of protobuf ``Record`` messages) to check what was logged.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from conftest import requires

pytestmark = pytest.mark.dist

wandb_pb = requires("wandb.proto.wandb_internal_pb2")

STEPS = 3
SECRET = "sentinel0wandb0api0key0never0printed00042"  # 40 characters, like a real key


def network_isolation() -> list[str]:
    """The command prefix that runs in a network namespace with loopback only, or [] if refused."""
    if not shutil.which("unshare") or not shutil.which("ip"):
        return []
    probe = subprocess.run(["unshare", "-n", "sh", "-c", "ip link set lo up"], capture_output=True)
    return (
        ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"] if probe.returncode == 0 else []
    )


def wandb_records(path: Path) -> list[Any]:
    """Every protobuf Record in a ``.wandb`` file (7-byte header, then 32 KiB LevelDB log blocks of
    7-byte-framed chunks: FULL=1 or FIRST=2/MIDDLE=3/LAST=4)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, payload, records = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer too short for a header: zero padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        payload += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_pb.Record()
            record.ParseFromString(payload)
            records.append(record)
            payload = b""
    return records


def items(entries: Any) -> dict[str, Any]:
    return {(e.key or "/".join(e.nested_key)): json.loads(e.value_json) for e in entries}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("wandb")
    home, run_dir = base / "home", base / "run"
    home.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("WANDB_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    }
    env.update(
        HOME=str(home),
        XDG_CACHE_HOME=str(home / ".cache"),
        XDG_CONFIG_HOME=str(home / ".config"),
        WANDB_API_KEY=SECRET,
        GLOO_SOCKET_IFNAME="lo",
        PYTHONUNBUFFERED="1",
    )
    prefix = network_isolation()
    if not prefix:
        why = "unshare -n (or ip) is unavailable or refused here: the wandb run would not be network-isolated"
        if os.environ.get("CI") == "true":  # CI must prove "no network", not assume it
            pytest.fail(f"CI=true but {why}", pytrace=False)
        warnings.warn(why, stacklevel=1)
    proc = subprocess.run(
        [
            *prefix,
            sys.executable,
            "-m",
            "distaccum",
            "train",
            "model=mlp",
            f"trainer.max_steps={STEPS}",
            "log.wandb=true",
            "log.wandb_mode=offline",
            "log.console=bar",
            f"run_dir={run_dir}",
        ],
        cwd=base,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    return {"proc": proc, "home": home, "run_dir": run_dir, "base": base, "isolated": bool(prefix)}


def test_offline_run_lives_under_run_dir_and_nothing_in_home(run: dict[str, Any]) -> None:
    run_dir: Path = run["run_dir"]
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1
    run_id = (run_dir / "wandb" / "run_id").read_text().strip()
    assert (offline[0] / f"run-{run_id}.wandb").is_file()
    assert list(run["home"].rglob("*")) == []  # wandb wrote no cache, config or settings to $HOME


def test_every_optimizer_step_is_logged_once_with_the_jsonl_record(run: dict[str, Any]) -> None:
    run_dir: Path = run["run_dir"]
    jsonl = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = wandb_records(next((run_dir / "wandb").glob("offline-run-*/run-*.wandb")))
    history = [items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    assert [h["_step"] for h in history] == [r["step"] for r in jsonl] == list(range(1, STEPS + 1))
    for logged, written in zip(history, jsonl, strict=True):
        for key in ("loss", "comm_bytes", "comm_s", "comm_exposed_s", "samples_per_s", "peak_mem_bytes"):
            assert logged[key] == written[key]
    summary: dict[str, Any] = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update(items(r.summary.update))
    assert summary["final_loss"] == json.loads((run_dir / "summary.json").read_text())["final_loss"]


def test_the_api_key_is_never_printed_or_written(run: dict[str, Any]) -> None:
    proc = run["proc"]
    assert "step 3/3" in proc.stdout  # the console sink ran, unbothered by wandb
    assert SECRET not in proc.stdout and SECRET not in proc.stderr
    for path in run["base"].rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path


def test_eval_lines_reach_wandb_at_the_step_they_follow(tmp_path: Path) -> None:
    import wandb

    from distaccum.evaluate import EvalResult
    from distaccum.telemetry.wandb_sink import WandbSink

    saved = dict(os.environ)  # WandbSink points wandb's directories into the run through the environment
    try:
        for var in [k for k in os.environ if k.startswith("WANDB_")]:
            del os.environ[var]
        sink = WandbSink(tmp_path / "run", {"model": "x"}, mode="offline", quiet=True)
        sink.log({"step": 1, "loss": 2.5})
        sink.log(EvalResult(loss=2.25, items=100, samples=4, seconds=0.1).record(1))
        sink.log({"step": 2, "loss": 2.0})
        sink.close({"final_loss": 2.0, "eval_loss": 2.25})
        wandb.teardown()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    records = wandb_records(next((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")))
    history = [items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    assert [h["_step"] for h in history] == [1, 2]
    assert history[0]["loss"] == 2.5 and history[0]["eval_loss"] == 2.25
    assert history[0]["eval_ppl"] == pytest.approx(9.487735836358526) and "eval_loss" not in history[1]
