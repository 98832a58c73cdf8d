"""The package's import rules, read from the source by an AST walk (nothing is imported):

- no cycle among the package's modules, counting imports inside functions too;
- nothing imports upward against the pipeline's layers (LAYERS below), and nothing but the studio imports the CLI;
  export reads what training wrote through run_folder.py and files.py, never by importing training;
- our own modules are imported at module top, never inside a function (third-party packages may be imported
  lazily; the CLI's subcommand table names its modules as strings for importlib, which is not an import statement);
- the objective is chosen once: no `.objective` attribute outside config/ and training/objectives/ (everything else
  asks the object `objective_for(config)` returns);
- the components below training take the fields they read, never a config: no module of data/, model/ or backends/
  imports config/schemas.py (the configs); it declares what it reads as a protocol, or takes a block of
  config/blocks.py, which a config is made of;
- only backends/ knows which backend runs: elsewhere no accelerate DistributedType, no device compared with "xla",
  no DeepSpeed `ds_*` parameter attribute; the code asks the backend what it supports instead.

Each rule reports every violation at once, each naming the importing file and line and the module it imports.
The last tests plant each kind of violation in a small package under tmp_path and check that it is caught.
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.paths import REPO

PACKAGE = "gpt4all_training"
# Which layers each layer may import, besides its own modules. cli may import everything; only the studio lists cli.
FOUNDATIONS = {"config", "batch", "errors", "files", "run_folder", "readers", "paths", "progress", "library_warnings",
               "intervals"}
COMPONENTS = {"data", "model", "backends", "tracking"}
STAGES = {"preflight", "analysis", "generation", "export", "evaluation", "serving"}
LAYERS: dict[str, set[str]] = {
    "cli": {"studio", "training", *STAGES, *COMPONENTS, *FOUNDATIONS},
    # The web app: a window over the stages and training that runs the CLI's own commands (their `execute`).
    "studio": {"cli", "training", *STAGES, *COMPONENTS, *FOUNDATIONS},
    **{stage: {"training", *COMPONENTS, *FOUNDATIONS} for stage in STAGES},
    "export": {*COMPONENTS, *FOUNDATIONS},
    "training": {*COMPONENTS, *FOUNDATIONS},
    **{component: FOUNDATIONS for component in COMPONENTS},
    "config": {"errors", "files", "readers", "paths"},
    "batch": set(),
    # The lowest layer beside errors, importable by every layer: crash-safe files, and the readers of input files.
    "files": {"errors"},
    # The names and paths of a training run's output_dir.
    "run_folder": set(),
    "readers": {"errors"},
    "paths": {"errors"},
    # Progress bars for long phases, and the third-party warnings hidden once for every command.
    "progress": set(),
    "library_warnings": set(),
    # Scores' 95% intervals and paired comparisons (numpy and scipy only).
    "intervals": set(),
    "errors": set(),
}


@dataclass(frozen=True)
class Edge:
    """`source` (a file) imports module `target` at `line`; `lazy` when the import runs inside a function."""
    source: Path
    line: int
    importer: str
    target: str
    lazy: bool

    def where(self, root: Path) -> str:
        return f"{self.source.relative_to(root).as_posix()}:{self.line} imports {self.target}"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_of(root: Path, package: str) -> dict[str, Path]:
    """{dotted module name: file} for every .py file of `package`, which lies under `root`."""
    return {module_name(path, root): path for path in sorted((root / package).rglob("*.py"))}


class ImportCollector(ast.NodeVisitor):
    """Every import of a module of `package` in one file, resolved to the module it loads."""

    def __init__(self, importer: str, is_package: bool, package: str, known: set[str]):
        self.importer, self.is_package, self.package, self.known = importer, is_package, package, known
        self.found: list[tuple[int, str, bool]] = []
        self.depth = 0  # functions around the node being visited

    def visit_FunctionDef(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def add(self, line: int, name: str) -> None:
        found = (line, name, self.depth > 0)
        if (name == self.package or name.startswith(self.package + ".")) and found not in self.found:
            self.found.append(found)

    def visit_Import(self, node):
        for alias in node.names:
            self.add(node.lineno, alias.name)

    def visit_ImportFrom(self, node):
        base = node.module or ""
        if node.level:  # relative: from the importer's package, up level - 1 more
            here = self.importer.split(".") if self.is_package else self.importer.split(".")[:-1]
            here = here[:len(here) - (node.level - 1)]
            base = ".".join([*here, *([base] if base else [])])
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            self.add(node.lineno, submodule if submodule in self.known else base)


def import_edges(root: Path, package: str) -> list[Edge]:
    modules = modules_of(root, package)
    edges = []
    for name, path in modules.items():
        collector = ImportCollector(name, path.name == "__init__.py", package, set(modules))
        collector.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        edges += [Edge(path, line, name, target, lazy) for line, target, lazy in collector.found
                  if target != name]
    return edges


def layer_of(module: str) -> str:
    """The sub-package (or top-level module) a module belongs to; "" for the package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward_imports(root: Path, package: str) -> list[str]:
    """Imports across layers that LAYERS does not allow, and modules in no layer."""
    unplaced = sorted({layer_of(name) for name in modules_of(root, package)} - set(LAYERS) - {""})
    problems = [f"{package}.{layer} is in no layer: add {layer!r} to LAYERS in tests/test_imports.py"
                for layer in unplaced]
    for edge in import_edges(root, package):
        source, target = layer_of(edge.importer), layer_of(edge.target)
        if source == target or target == "" or target in LAYERS.get(source, set()):
            continue
        reason = "only the studio imports cli" if target == "cli" else f"{source or package} may not import {target}"
        problems.append(f"{edge.where(root)} ({reason})")
    return problems


def strongly_connected(graph: dict[str, dict[str, Edge]]) -> list[list[str]]:
    """Tarjan's strongly connected components of the import graph."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def shortest_cycle(graph: dict[str, dict[str, Edge]], start: str, group: set[str]) -> list[str]:
    """The shortest path start -> ... -> start inside `group` (breadth first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph.get(node, {})):
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if target in group and target not in previous:
                    previous[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"{start} is in no cycle")


def cycles(root: Path, package: str) -> list[str]:
    """One line per group of modules that import each other in a circle: its shortest cycle through the group's
    first module, with the import of each step, and the group's other members when there are more."""
    graph: dict[str, dict[str, Edge]] = {}
    for edge in import_edges(root, package):
        graph.setdefault(edge.importer, {}).setdefault(edge.target, edge)
    problems = []
    for group in strongly_connected(graph):
        if len(group) < 2:
            continue
        path = shortest_cycle(graph, group[0], set(group))
        steps = "; ".join(graph[a][b].where(root) for a, b in zip(path, path[1:]))
        others = sorted(set(group) - set(path))
        problems.append(f"cycle {' -> '.join(path)}: {steps}" + (f" (also in it: {', '.join(others)})" if others else ""))
    return problems


def lazy_imports(root: Path, package: str) -> list[str]:
    return [f"{edge.where(root)} inside a function (import our own modules at module top)"
            for edge in import_edges(root, package) if edge.lazy]


# Where `.objective` may be written or read: the config that declares it, and the package that acts on it.
OBJECTIVE_READERS = ("config", "training/objectives")


def objective_reads(root: Path, package: str) -> list[str]:
    """Every `.objective` attribute (read, written or deleted) in the package outside OBJECTIVE_READERS."""
    allowed = tuple(root / package / folder for folder in OBJECTIVE_READERS)
    problems = []
    for path in sorted((root / package).rglob("*.py")):
        if any(path.is_relative_to(folder) for folder in allowed):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        lines = sorted(node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                       and node.attr == "objective")
        problems += [f"{path.relative_to(root).as_posix()}:{line} uses .objective (ask the object "
                     f"objective_for(config) returns)" for line in lines]
    return problems


# The packages that take blocks of fields, and the module of the configs that they may not import.
CONFIG_FREE = ("data", "model", "backends")
SCHEMAS = f"{PACKAGE}.config.schemas"


def config_imports(root: Path, package: str) -> list[str]:
    """Every import of config/schemas.py (type-checking imports too) by a module of CONFIG_FREE."""
    return [f"{edge.where(root)} ({layer_of(edge.importer)}/ takes the blocks it reads, not a config: declare them as "
            f"a protocol or import the block from config/blocks.py)" for edge in import_edges(root, package)
            if layer_of(edge.importer) in CONFIG_FREE and edge.target == SCHEMAS]


class BackendSniffing(ast.NodeVisitor):
    """Where one file asks which backend runs: accelerate's DistributedType (or an Accelerator's distributed_type),
    a device type compared with "xla", DeepSpeed's ds_* attributes of a parameter (read directly or by name)."""

    def __init__(self) -> None:
        self.found: list[tuple[int, str]] = []

    def add(self, node: ast.AST, what: str) -> None:
        self.found.append((node.lineno, what))

    def visit_ImportFrom(self, node):
        if any(alias.name == "DistributedType" for alias in node.names):
            self.add(node, "imports DistributedType")

    def visit_Name(self, node):
        if node.id == "DistributedType":
            self.add(node, "names DistributedType")

    def visit_Attribute(self, node):
        if node.attr in ("DistributedType", "distributed_type"):
            self.add(node, f"reads .{node.attr}")
        elif node.attr.startswith("ds_"):
            self.add(node, f"uses DeepSpeed's .{node.attr}")
        self.generic_visit(node)

    def visit_Call(self, node):
        named = node.args[1] if len(node.args) >= 2 else None
        if isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "setattr") and \
                isinstance(named, ast.Constant) and str(named.value).startswith("ds_"):
            self.add(node, f"uses DeepSpeed's .{named.value}")
        self.generic_visit(node)

    def visit_Compare(self, node):
        operands = []
        for operand in (node.left, *node.comparators):
            operands += operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
        if any(isinstance(o, ast.Constant) and o.value == "xla" for o in operands) and \
                any(isinstance(o, ast.Attribute) and o.attr == "type" for o in operands):
            self.add(node, 'compares a device type with "xla"')
        self.generic_visit(node)


def backend_sniffing(root: Path, package: str) -> list[str]:
    """Every place outside backends/ that asks which backend runs, by file and line."""
    problems = []
    for name, path in modules_of(root, package).items():
        if layer_of(name) == "backends":
            continue
        finder = BackendSniffing()
        finder.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        problems += [f"{path.relative_to(root).as_posix()}:{line} {what} (only backends/ knows which backend runs: "
                     f"ask the backend what it supports)" for line, what in sorted(finder.found)]
    return problems


def fail_on(problems: list[str]) -> None:
    if problems:
        pytest.fail(f"{len(problems)} violation(s):\n" + "\n".join(problems), pytrace=False)


def test_no_import_cycles():
    fail_on(cycles(REPO, PACKAGE))


def test_nothing_imports_upward_against_the_layers():
    fail_on(upward_imports(REPO, PACKAGE))


def test_our_own_modules_are_imported_at_module_top():
    fail_on(lazy_imports(REPO, PACKAGE))


def test_only_config_and_the_objectives_read_the_objective():
    fail_on(objective_reads(REPO, PACKAGE))


def test_only_backends_know_which_backend_runs():
    fail_on(backend_sniffing(REPO, PACKAGE))


def test_data_model_and_backends_never_import_a_config():
    fail_on(config_imports(REPO, PACKAGE))


# ---------------------------------------------------------------- the checker on planted violations

def write_package(root: Path, files: dict[str, str]) -> Path:
    for relative, text in {"gpt4all_training/__init__.py": "", **files}.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.parents:
            if parent == root:
                break
            (parent / "__init__.py").touch()
        path.write_text(textwrap.dedent(text), encoding="utf-8")
    return root


def test_a_planted_cycle_is_named_with_each_import(tmp_path):
    """data.records -> data.rows at module top, data.rows -> data.records inside a function."""
    root = write_package(tmp_path, {
        "gpt4all_training/data/records.py": "from gpt4all_training.data import rows\n",
        "gpt4all_training/data/rows.py": """\
            import json

            def cut():
                from .records import read
                return read
            """,
        "gpt4all_training/config/loader.py": "from gpt4all_training.errors import UserError\n",
        "gpt4all_training/errors.py": "class UserError(Exception):\n    pass\n",
    })
    assert cycles(root, PACKAGE) == [
        "cycle gpt4all_training.data.records -> gpt4all_training.data.rows -> gpt4all_training.data.records: "
        "gpt4all_training/data/records.py:1 imports gpt4all_training.data.rows; "
        "gpt4all_training/data/rows.py:4 imports gpt4all_training.data.records"]
    assert lazy_imports(root, PACKAGE) == [
        "gpt4all_training/data/rows.py:4 imports gpt4all_training.data.records inside a function (import our own "
        "modules at module top)"]
    assert upward_imports(root, PACKAGE) == []


def test_planted_upward_and_sideways_imports_and_an_import_of_the_cli_are_named(tmp_path):
    root = write_package(tmp_path, {
        "gpt4all_training/config/loader.py": "import gpt4all_training.training.loop\n",
        "gpt4all_training/data/sft.py": "from gpt4all_training.model.loading import load_model\n",
        "gpt4all_training/export/hf.py": """\
            from gpt4all_training.preflight import plan
            from gpt4all_training.training.checkpoint import verify
            """,
        "gpt4all_training/training/loop.py": """\
            import torch

            from gpt4all_training.cli import main
            from gpt4all_training.data.sft import load_data
            """,
        "gpt4all_training/model/loading.py": "",
        "gpt4all_training/preflight/plan.py": "",
        "gpt4all_training/training/checkpoint.py": "",
        "gpt4all_training/cli/main.py": "from gpt4all_training.training.loop import train\n",
        "gpt4all_training/extras/thing.py": "",
    })
    assert upward_imports(root, PACKAGE) == [
        "gpt4all_training.extras is in no layer: add 'extras' to LAYERS in tests/test_imports.py",
        "gpt4all_training/config/loader.py:1 imports gpt4all_training.training.loop (config may not import training)",
        "gpt4all_training/data/sft.py:1 imports gpt4all_training.model.loading (data may not import model)",
        "gpt4all_training/export/hf.py:1 imports gpt4all_training.preflight.plan (export may not import preflight)",
        "gpt4all_training/export/hf.py:2 imports gpt4all_training.training.checkpoint (export may not import "
        "training)",
        "gpt4all_training/training/loop.py:3 imports gpt4all_training.cli.main (only the studio imports cli)",
    ]
    assert lazy_imports(root, PACKAGE) == []


def test_planted_objective_reads_outside_config_and_the_objectives_are_named(tmp_path):
    root = write_package(tmp_path, {
        "gpt4all_training/config/schemas.py": "def dpo(config):\n    return config.objective == 'dpo'\n",
        "gpt4all_training/training/objectives/__init__.py": "def name(config):\n    return config.objective\n",
        "gpt4all_training/training/objectives_old.py": "def name(config):\n    return config.objective\n",
        "gpt4all_training/preflight/check.py": """\
            def pairs(config):
                sequences = 2 if config.objective == "dpo" else 1
                return sequences

            def rename(config):
                config.objective = "sft"
            """,
        "gpt4all_training/cli/data.py": "def name(args, config):\n    return getattr(config, 'name', args.objective)\n",
    })
    reason = "uses .objective (ask the object objective_for(config) returns)"
    assert objective_reads(root, PACKAGE) == [f"gpt4all_training/{where} {reason}" for where in (
        "cli/data.py:2", "preflight/check.py:2", "preflight/check.py:6", "training/objectives_old.py:2")]


def test_planted_backend_sniffing_is_named_and_backends_may_do_it(tmp_path):
    """What training/loss.py, model/parameters.py and a loop once did, each outside backends/, and the same code
    inside backends/, where it belongs."""
    sniffing = """\
        from accelerate.utils import DistributedType

        def head(model, batch, accelerator, param):
            if accelerator.distributed_type == DistributedType.DEEPSPEED:
                return None
            found = None if batch["input_ids"].device.type == "xla" else model
            if param.device.type in ("cpu", "xla") or hasattr(param, "ds_id"):
                return getattr(param, "ds_numel", param.numel())
            return param.ds_tensor.numel()
        """
    root = write_package(tmp_path, {"gpt4all_training/training/loss.py": sniffing,
                                    "gpt4all_training/backends/deepspeed.py": sniffing})
    where = "gpt4all_training/training/loss.py"
    because = "(only backends/ knows which backend runs: ask the backend what it supports)"
    assert backend_sniffing(root, PACKAGE) == [
        f"{where}:1 imports DistributedType {because}",
        f"{where}:4 names DistributedType {because}",
        f"{where}:4 reads .distributed_type {because}",
        f'{where}:6 compares a device type with "xla" {because}',
        f'{where}:7 compares a device type with "xla" {because}',
        f"{where}:7 uses DeepSpeed's .ds_id {because}",
        f"{where}:8 uses DeepSpeed's .ds_numel {because}",
        f"{where}:9 uses DeepSpeed's .ds_tensor {because}",
    ]


def test_planted_config_imports_below_training_are_named(tmp_path):
    """A loader, a model builder and a backend that each name the training config (one under TYPE_CHECKING, one by
    `from ... import schemas`); a block import beside them, and training's own import of the config, are allowed."""
    configs = {"gpt4all_training/config/blocks.py": "class Examples: ...\n",
               "gpt4all_training/config/schemas.py": "from gpt4all_training.config.blocks import Examples\n"}
    root = write_package(tmp_path, {
        **configs,
        "gpt4all_training/data/sft.py": """\
            from gpt4all_training.config.blocks import Examples
            from gpt4all_training.config.schemas import TrainConfig
            """,
        "gpt4all_training/model/build.py": """\
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from gpt4all_training.config.schemas import TrainConfig
            """,
        "gpt4all_training/backends/accelerate.py": "from gpt4all_training.config import schemas\n",
        "gpt4all_training/training/loop.py": "from gpt4all_training.config.schemas import TrainConfig\n",
    })
    assert config_imports(root, PACKAGE) == [
        f"gpt4all_training/{where} imports gpt4all_training.config.schemas ({layer}/ takes the blocks it reads, not a "
        f"config: declare them as a protocol or import the block from config/blocks.py)"
        for where, layer in (("backends/accelerate.py:1", "backends"), ("data/sft.py:2", "data"),
                             ("model/build.py:3", "model"))]
    assert config_imports(write_package(tmp_path / "clean", configs), PACKAGE) == []
