"""The CPU window's transport (:mod:`distaccum.cluster.exchange`) on real gloo ranks, when something goes wrong:
the fallback to gloo when the sockets cannot be made, and a dead or hung peer named in the error the run fails
with. (That both transports give the same totals bit for bit: ``tests/test_ddp_accum.py``; that a stopped rank
fails a whole run in time, named: ``tests/test_faults.py``.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

WORKER = Path(__file__).parent / "fixtures" / "exchange_faults.py"


def launch(tmp_path: Path, mode: str) -> tuple[dict, str]:
    out = tmp_path / f"{mode}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(WORKER), mode, str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stderr


@pytest.mark.parametrize("mode", ["unbindable", "elsewhere"])
def test_every_rank_falls_back_to_gloo_together_and_the_rows_still_travel(tmp_path: Path, mode: str) -> None:
    seen, err = launch(tmp_path, mode)
    assert seen["kind"] == "gloo"
    assert seen["rows"] == [[0.0, 0.0], [1.0, 2.0]]
    warned = "distaccum: warning: the window's totals go through gloo, not this host's Unix sockets (a rank could not"
    assert (warned in err) == (mode == "unbindable"), err[-2000:]  # another host: gloo as expected, no warning


def test_a_peer_that_exits_fails_the_exchange_at_once_naming_it(tmp_path: Path) -> None:
    seen, _ = launch(tmp_path, "dead")
    assert seen["kind"] == "sockets"
    assert seen["error"].startswith("ConnectionError: the window's exchange: rank 1 closed its socket"), seen
    assert "it exited or failed" in seen["error"] and not seen["timeout"]
    assert seen["waited_s"] < 10  # its 30 s timeout not waited out


def test_a_hung_peer_times_the_exchange_out_after_the_timeout_naming_it(tmp_path: Path) -> None:
    seen, _ = launch(tmp_path, "hung")
    assert seen["kind"] == "sockets"
    assert seen["error"].startswith("TimeoutError: the window's exchange timed out: rank 0 waited 1 s for rank 1's row")
    assert seen["timeout"]  # the Trainer's failure message then names trainer.collective_timeout_s
    assert 1.0 <= seen["waited_s"] < 3.5


def test_one_exchange_waited_for_on_two_threads_gives_both_the_same_rows_and_leaves_the_next_intact(
        tmp_path: Path) -> None:
    """DDP runs a comm hook's continuation on the process group's threads, one per bucket: two buckets may ask for
    the window's scale at once. Both must get the window's rows, and no byte of the next window's may be taken."""
    seen, _ = launch(tmp_path, "threads")
    assert seen["kind"] == "sockets"
    assert seen["first"] == [[[0.0, 0.5, 0.25], [1.0, 1.5, 1.25]]] * 2
    assert seen["second"] == [[0.0, 0.0, 0.0], [2.0, 2.5, 2.25]]
