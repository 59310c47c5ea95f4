"""Fault-tolerant replica groups' refusals and errors, each one clear line (a real Lighthouse and Manager, no mocks)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import requires
from distaccum.config import ConfigError, from_mapping
from distaccum.ft.config import FtConfig
from distaccum.ft.session import FtError, FtSession, resolvable_host

pytestmark = pytest.mark.unit
# torchft's Rust logger reads RUST_LOG once, when torchft is imported (a launch sets it first, as here)
os.environ.setdefault("RUST_LOG", "warn")
requires("torchft")


def test_the_config_refuses_what_cannot_form_groups() -> None:
    with pytest.raises((ValueError, ConfigError), match="at least 2 replica groups"):
        from_mapping({"ft": {"groups": 1}})
    with pytest.raises((ValueError, ConfigError), match="between 1 and ft.groups=3"):
        from_mapping({"ft": {"groups": 3, "min_groups": 4}})
    FtConfig(groups=3, min_groups=2).check_split(24, 2, 1)  # 24 = 2 x 6 x 2 = 2 x 4 x 3
    with pytest.raises(ValueError, match="over 2 group"):
        FtConfig(groups=3, min_groups=1).check_split(18, 2, 1)  # 9 micro-batches do not split over 2 groups


def test_a_host_name_that_does_not_resolve_is_one_line() -> None:
    with pytest.raises(FtError, match=r"'no-such-host\.invalid' does not resolve.*ft\.hostname"):
        resolvable_host(FtConfig(groups=2, hostname="no-such-host.invalid"))


def test_an_unreachable_lighthouse_and_too_few_groups_are_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed import TCPStore
    from torchft.coordination import LighthouseServer

    def session(lighthouse: str) -> FtSession:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the group's own store
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(store.port))
        cfg = FtConfig(groups=2, min_groups=2, lighthouse=lighthouse, timeout_s=0.3, quorum_timeout_s=0.3)
        made = FtSession(cfg, 0, 0, 1, tmp_path)
        made.store = store  # type: ignore[attr-defined]  # kept alive with the session
        return made

    with pytest.raises(
        FtError, match=r"^ft: the Lighthouse at http://127\.0\.0\.1:1 is unreachable \(RuntimeError"
    ):
        session("http://127.0.0.1:1").start(dict, lambda state: None)
    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=2, join_timeout_ms=100, heartbeat_timeout_ms=300
    )
    try:
        alone = session(lighthouse.address())
        alone.start(dict, lambda state: None)
        with pytest.raises(FtError, match=r"^ft: no quorum of ft\.min_groups=2 replica group\(s\) within"):
            alone.quorum(0)
        alone.shutdown()
    finally:
        lighthouse.shutdown()
    assert "INFO Started CheckpointServer" in (tmp_path / "torchft.log").read_text()  # not on the console


def test_what_cannot_form_groups_is_refused_before_any_group_starts() -> None:
    from distaccum.ft.launch import check

    base = {"ft": {"groups": 3}, "accum": {"global_batch": 24, "micro_batch": 2}, "trainer": {"nproc": 1}}
    check(from_mapping(base))  # DDP, 24 samples over 1, 2 or 3 groups of one rank
    for change, why in (
        ({"engine": {"name": "deepspeed"}}, "ZeRO partitions the optimizer state"),
        ({"engine": {"name": "accelerate"}}, "Accelerate steps its own wrapped optimizer"),
        ({"engine": {"name": "fsdp"}}, "set trainer.fingerprint=false"),
        ({"outer": {"method": "diloco", "islands": 1}}, "outer.method already reduces"),
        (
            {"accum": {"global_batch": 18, "micro_batch": 2}},
            "does not split into micro-batches of 2 over 2 group",
        ),
    ):
        with pytest.raises(ValueError, match=why):
            check(from_mapping({**base, **change}))
    check(from_mapping({**base, "engine": {"name": "fsdp"}, "trainer": {"nproc": 1, "fingerprint": False}}))
    # Exact accumulation forms groups (its int64 sum crosses them: tests/test_ft.py); it takes no reduction checksum,
    # so FSDP2's fingerprint needs no switching off there.
    exact = {"accum": {"global_batch": 24, "micro_batch": 2, "exact": True}}
    check(from_mapping({**base, **exact}))
    check(from_mapping({**base, **exact, "engine": {"name": "fsdp"}}))


def test_submit_renders_replica_groups_and_refuses_what_it_cannot_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`distaccum submit --to ray --dry-run` says how the groups would run on Ray; a real submit there refuses in one
    line (Slurm and Kubernetes: tests/test_slurm_render.py, tests/test_kubeflow_render.py)."""
    from distaccum.cli.submit import submit_main
    from distaccum.cluster.ray_train import RayError, RayLauncher

    assert submit_main(["--to", "ray", "--dry-run", "model=mlp", "ft.groups=2", "trainer.nproc=1"]) == 0
    out = capsys.readouterr().out
    assert (
        "ft: the torchft Lighthouse in one Ray actor" in out
        and "FailureConfig(max_failures=ft.restarts=3)" in out
    )
    with pytest.raises(RayError, match="does not start replica groups yet"):
        RayLauncher.submit(from_mapping({"ft": {"groups": 2}}), [])
