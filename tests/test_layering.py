"""The module graph stays a DAG, the library stays free of entry-layer concerns, and the structure the
architecture promises holds (STYLE.md): one place builds an EngineSpec, nothing below the Trainer takes the
whole RunConfig, the loop is the step math, capabilities live on engine classes, faults come through the
one testing seam.

Imports are read from the source (``ast``), module level *and* inside function bodies, so a cycle
"dodged" with a function-local import is still a cycle here.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.unit

PACKAGE = REPO / "distaccum"
ENTRY_PREFIXES = ("distaccum.cli", "distaccum.__main__")
ENTRY_ONLY_PACKAGES = {"hydra", "omegaconf"}
HYDRA_INSTANTIATION = "distaccum.preflight"
"""The one library module that turns ``_target_`` nodes into objects (Hydra's ``instantiate``)."""
RESOLUTION = {"distaccum.config", "distaccum.resolve", "distaccum.trainer", "distaccum.features.base"}
"""Where a whole RunConfig may be taken at or below the Trainer: the config itself, its resolution, the Trainer
(which hands narrow pieces down) and the run it assembles for the feature set-ups (each decides from it whether it
is on, at the Trainer's floor)."""


def _name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_name(p): p for p in PACKAGE.rglob("*.py") if "configs" not in p.parts}


def _imports(path: Path, module: str) -> set[str]:
    """Every module imported anywhere in ``path`` (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return names


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: {i for i in _imports(path, name) if i in modules and i != name}
        for name, path in modules.items()
    }


def test_library_never_imports_the_entry_layer_or_hydra() -> None:
    for name, path in _modules().items():
        if name.startswith(ENTRY_PREFIXES):
            continue
        for imported in _imports(path, name):
            if name != HYDRA_INSTANTIATION or imported.split(".")[0] != "hydra":
                assert imported.split(".")[0] not in ENTRY_ONLY_PACKAGES, (
                    f"{name} imports {imported} (entry layer only)"
                )
            assert not imported.startswith(ENTRY_PREFIXES), (
                f"library module {name} imports entry module {imported}"
            )
        assert "sys.exit" not in path.read_text(), f"{name} calls sys.exit (entry layer only)"


def test_imports_form_a_dag_including_function_local_ones() -> None:
    graph = _graph()
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        if state.get(node) == 2:
            return
        assert state.get(node) != 1, "import cycle: " + " -> ".join([*trail, node])
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if dep == "distaccum" or node == "distaccum":  # the package's lazy exports
                continue
            visit(dep, [*trail, node])
        state[node] = 2

    for module in sorted(graph):
        visit(module, [])


def test_the_checker_sees_cycles_hidden_in_function_bodies(tmp_path: Path) -> None:
    source = "def f():\n    from distaccum.loop import train\n"
    (tmp_path / "x.py").write_text(source)
    assert "distaccum.loop" in _imports(tmp_path / "x.py", "distaccum.x")


def test_engines_import_only_the_engine_base_and_leaf_modules() -> None:
    graph = _graph()
    for name, deps in graph.items():
        if name.startswith("distaccum.engines.") and name != "distaccum.engines.base":
            other_engines = {d for d in deps if d.startswith("distaccum.engines.")} - {
                "distaccum.engines.base",
                "distaccum.engines.comm_tap",
                "distaccum.engines.deepspeed_config",
                "distaccum.engines.compile",
            }
            if (
                name == "distaccum.engines.accelerate"
            ):  # Accelerate drives DDP: it shares DDP's replicated base
                other_engines -= {"distaccum.engines.ddp"}
            assert not other_engines, f"{name} imports {other_engines}"
            assert "distaccum.loop" not in deps and "distaccum.trainer" not in deps, name


def _room(module: str) -> str | None:
    """A module's folder ("room"): its subpackage of distaccum, or a top-level module as its own room (None: the
    package itself, whose lazy exports import on first use)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _folder_pairs() -> dict[tuple[str, str], list[str]]:
    """Pairs of rooms that import each other (sorted names) -> the imports each way."""
    edges: dict[tuple[str, str], list[str]] = {}
    for name, deps in _graph().items():
        for dep in deps:
            a, b = _room(name), _room(dep)
            if a and b and a != b:
                edges.setdefault((a, b), []).append(f"{name} -> {dep}")
    return {(a, b): sorted(edges[(a, b)] + edges[(b, a)]) for a, b in edges if a < b and (b, a) in edges}


FOLDER_PAIRS = {
    ("batching", "verify"): (
        "the batch growth's verify rules (batching.verify_rules) are built on verify's protocol (verify.rules); "
        "the plain reference takes each step's window of a ramp (batching.growth)"
    ),
    ("batching", "config"): (
        "a leaf config section: config imports batching.config; batching.growth reads RunConfig"
    ),
    ("cluster", "config"): (
        "a leaf config section: config imports cluster.config (the launchers' sections); the launchers read RunConfig"
    ),
    ("config", "data"): (
        "a leaf config section: config imports data.config (data, eval); the data pipeline reads RunConfig"
    ),
    ("config", "outer"): "a leaf config section: config imports outer.config; outer.simulate reads RunConfig",
    ("config", "ft"): "a leaf config section: config imports ft.config; ft.launch writes each group's config",
    ("config", "verify"): (
        "a leaf config section: config imports verify.config; the verify command reads RunConfig"
    ),
    ("outer", "verify"): (
        "outer.simulate is the feature's own reference rule, built on verify.reference; verify runs it and diagnoses "
        "a merge with outer.sync's fragments"
    ),
    ("outer", "rundir"): (
        "a leaf config section: rundir.changes reads outer.config's renamed keys (a checkpoint's old outer.replicas); "
        "outer.simulate writes its reference run's weights through rundir"
    ),
    ("trainer", "tuning"): (
        "micro_batch=auto searches inside the Trainer (tuning.autobatch); the planner measures through the Trainer "
        "(tuning.planner)"
    ),
}
"""The folders that import each other, each with its reason (STYLE: a folder is one floor; only leaf config sections
may be imported both ways). A new pair fails the test: move the module to the floor it runs at, or name the pair here
with its reason."""


def test_folders_import_each_other_only_where_named() -> None:
    found = _folder_pairs()
    new = {pair: found[pair][:4] for pair in sorted(set(found) - set(FOLDER_PAIRS))}
    assert not new, f"folders that now import each other: {new}"
    gone = sorted(set(FOLDER_PAIRS) - set(found))
    assert not gone, f"no longer import each other (take them off FOLDER_PAIRS): {gone}"


def test_the_worker_runtime_imports_nothing_of_distaccum_above_it() -> None:
    """The worker runtime (contracts, process group, topology, stop requests) is the floor the Trainer and the
    launchers stand on: it imports only itself (module level and inside functions)."""
    for name, deps in sorted(_graph().items()):
        if name.startswith("distaccum.runtime"):
            above = sorted(d for d in deps if not d.startswith("distaccum.runtime"))
            assert not above, f"{name} imports {above}"


def test_the_guards_import_neither_the_verify_command_nor_the_trainer() -> None:
    """The per-step guards run below the Trainer and the loop; the verify command imports the Trainer and reads what
    the guards write, never the other way (module level, inside functions, and through other modules)."""
    for name in sorted(m for m in _modules() if m.startswith("distaccum.guards")):
        above = {
            m
            for m in _reachable(name)
            if m.startswith("distaccum.verify") or m in {"distaccum.trainer", "distaccum.loop"}
        }
        assert not above, f"{name} reaches {sorted(above)}"


def test_no_module_outgrows_its_concept() -> None:
    for name, path in _modules().items():
        lines = len(path.read_text().splitlines())
        assert lines <= 500, f"{name} has {lines} lines: split it by concept"


FEATURE_WORDS = {
    "outer", "islands", "ramp", "adaptive", "schedule", "gns", "compile", "fingerprint", "checkpointed",
    "checkpointing", "tripwire", "auto",
}  # fmt: skip
"""Words that name a feature (its config keys and parts), besides the registry's own names."""


def _method(module: str, cls: str, name: str) -> ast.FunctionDef:
    body = next(
        n for n in ast.parse(_source(module)).body if isinstance(n, ast.ClassDef) and n.name == cls
    ).body
    return next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)


def test_the_trainer_composes_features_without_naming_them() -> None:
    """``Trainer._setup`` composes the run from the registered feature set-ups (:mod:`distaccum.features`) in at most
    60 lines; no name in its body (a variable, an attribute, a config key it branches on) is a feature's."""
    from distaccum.features import FEATURES

    setup = _method("distaccum.trainer", "Trainer", "_setup")
    length = setup.end_lineno - setup.lineno + 1  # type: ignore[operator]
    assert length <= 60, f"Trainer._setup is {length} lines: features attach themselves (distaccum.features)"
    words = FEATURE_WORDS | set(FEATURES) | {w for name in FEATURES for w in name.split("_") if len(w) > 4}
    named = {
        n.attr if isinstance(n, ast.Attribute) else n.id
        for n in ast.walk(setup)
        if isinstance(n, ast.Attribute | ast.Name)
    }
    features = {n for n in named if n in words or set(n.strip("_").split("_")) & words}
    assert not features, f"Trainer._setup names features {sorted(features)}: give them a set-up of their own"
    assert {"before_engine", "with_engine", "with_state"} <= named


def test_every_registered_feature_setup_is_one() -> None:
    from distaccum.features import FEATURES, SetupBase, setup_class

    for name in FEATURES:
        cls = setup_class(name)
        assert issubclass(cls, SetupBase) and cls.name == name, FEATURES[name]


def test_the_verify_runner_takes_features_rules_from_their_rooms() -> None:
    lines = len(_source("distaccum.verify.runner").splitlines())
    assert lines <= 400, f"distaccum.verify.runner has {lines} lines: a feature's rules live in its own room"


def _reachable(start: str) -> set[str]:
    graph, seen, todo = _graph(), set(), [start]
    while todo:
        node = todo.pop()
        for dep in graph.get(node, ()):
            if dep not in seen and dep != "distaccum":
                seen.add(dep)
                todo.append(dep)
    return seen


def _source(module: str) -> str:
    return _modules()[module].read_text()


def test_nothing_below_the_trainer_takes_the_whole_run_config() -> None:
    below = _reachable("distaccum.trainer")
    assert "distaccum.resolve" in below and "distaccum.loop" in below
    for name in sorted(below - RESOLUTION):
        assert "distaccum.config.RunConfig" not in _imports(_modules()[name], name), (
            f"{name} (below the Trainer) imports RunConfig: hand it the narrow objects it uses"
        )


def test_an_engine_spec_is_built_in_exactly_one_place() -> None:
    builders = [
        (name, line)
        for name, path in _modules().items()
        for line in path.read_text().splitlines()
        if "EngineSpec(" in line and "class EngineSpec" not in line
    ]
    assert [name for name, _ in builders] == ["distaccum.resolve"], builders


def test_the_trainer_reads_no_environment() -> None:
    assert "os.environ" not in _source("distaccum.trainer") and "getenv" not in _source("distaccum.trainer")


def _function(module: str, name: str) -> ast.FunctionDef:
    return next(
        n for n in ast.parse(_source(module)).body if isinstance(n, ast.FunctionDef) and n.name == name
    )


def test_the_step_is_the_step_math() -> None:
    """``train_step`` is fetch -> K micro-steps -> one reduction -> clip -> step in at most 40 lines, with nothing
    of the timer, the records, the checks or the checkpointer in it (they run around it, in ``train``)."""
    step = _function("distaccum.loop", "train_step")
    length = step.end_lineno - step.lineno + 1  # type: ignore[operator]
    assert length <= 40, f"loop.train_step is {length} lines: the step math only"
    names = {
        n.attr if isinstance(n, ast.Attribute) else n.id
        for n in ast.walk(step)
        if isinstance(n, ast.Attribute | ast.Name)
    }
    around = {
        "timer",
        "sink",
        "records",
        "checkpointer",
        "monitors",
        "fingerprint",
        "on_step",
        "stop",
    } & names
    assert not around, f"loop.train_step reaches for {sorted(around)}: those run around the step, in train"
    loop = _function("distaccum.loop", "train")
    assert loop.end_lineno - loop.lineno + 1 <= 50, "loop.train: the cadence around the step, on one screen"


SOCKETS = re.compile(
    r"\bsocket\.(socket|socketpair|create_connection|create_server|fromfd)\b|\b(multiprocessing\."
    r"connection|asyncio\.open_(unix_)?connection|zmq)\b"
)


def test_no_module_opens_a_transport_of_its_own() -> None:
    """Per-step data travels in the run's own collectives (gloo, NCCL): nothing a training run imports opens a
    socket (a host name is not a transport; the launcher, which runs before any worker, may probe for a free port)."""
    modules = _modules()
    for name in sorted(_reachable("distaccum.trainer") | {"distaccum.trainer"}):
        found = SOCKETS.search(modules[name].read_text())
        assert found is None, f"{name} opens a transport of its own: {found.group(0) if found else ''}"
    assert SOCKETS.search("peer = socket.socket(socket.AF_UNIX)") and not SOCKETS.search(
        "socket.gethostname()"
    )


def test_one_normalization_path() -> None:
    """The window's 1/(c N) is applied in one place, the engine's step: none of the retired second and third paths
    (folded into the comm hook, multiplied into the loss at K = 1 above a size threshold) comes back."""
    retired = re.compile(
        r"normalize_in_loss_mb|fold_normalization|normalize_loss\b|hand_over|loss_factor|"
        r"micro_factor"
    )
    for path in [*_modules().values(), *(REPO / "configs").rglob("*.yaml")]:
        found = retired.search(path.read_text())
        assert found is None, f"{path.relative_to(REPO)}: {found.group(0) if found else ''}"


def test_the_top_level_package_stays_small() -> None:
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= 20, modules


def test_no_module_tests_an_engine_by_name() -> None:
    """Capabilities live on the engine classes; only the registry maps names to classes."""
    pattern = re.compile(
        r"""(name|engine)\s*(==|!=|in|not in)\s*[(\[]?\s*["'](ddp|fsdp|deepspeed|accelerate)["']"""
    )
    for name, path in _modules().items():
        if name.startswith(("distaccum.engines", "distaccum.cli")):
            continue
        found = pattern.search(path.read_text())
        assert found is None, f"{name} tests an engine's name: {found.group(0) if found else ''}"


def test_faults_enter_only_through_the_testing_seam_in_the_trainer() -> None:
    users = sorted(
        name
        for name, path in _modules().items()
        if "intercept(" in path.read_text() and not name.startswith("distaccum.testing")
    )
    assert users == ["distaccum.trainer"], users
    config = _source("distaccum.config")
    assert re.search(r"\b(debug|fault)", config, re.IGNORECASE) is None, (
        "a test-only switch in the public config"
    )


def test_the_launching_process_does_not_import_dynamo() -> None:
    """Every `distaccum train` runs the pre-flight and the launcher in a parent process before the workers start;
    importing torch._dynamo there (a module-level import of the compile watch did) cost about 2 s per command."""
    code = (
        "import sys, distaccum.cli.train, distaccum.preflight, distaccum.trainer, distaccum.cluster.local; "
        "print('torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "False"
