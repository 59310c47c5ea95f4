"""The run directory's writers: several writers of one file never break each other (issue 55: two elastic
launchers sharing a run_dir wrote ``status.json`` through one fixed temporary name, and one of them failed with
FileNotFoundError after training)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from distaccum.rundir import read_json, write_json

pytestmark = pytest.mark.unit


def test_concurrent_writers_of_one_file_each_succeed_and_leave_a_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def writer(who: int) -> None:
        start.wait()
        try:
            for i in range(300):
                write_json(path, {"writer": who, "i": i, "pad": "x" * 512})
        except BaseException as err:  # noqa: B036 - collected for the assertion below
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    value = read_json(path)
    assert value["i"] == 299 and value["writer"] in range(4)  # the last rename wins, whole
    assert json.loads(path.read_text()) == value
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]  # no temporary file left behind
