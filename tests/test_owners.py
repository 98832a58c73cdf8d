"""Who owns what on disk, read from the source by an AST walk (nothing is imported), in the style of test_imports.py:

- the run folder's names (`step_N/`, `final/`, `config.yaml`, `metrics.jsonl`, `run_id`, ...) are spelled in
  run_folder.py alone, and the completion marker's (`COMPLETE`) in files.py: no string literal elsewhere in the
  package or in bench/ (whose scripts read the runs they start) is one of them, and no f-string or pattern builds a `step_N` or `set-aside-K` name. Docstrings and
  mapping keys (a JSON field named `run_id`, a response's `final`) are prose and data, not names on disk;
- files are renamed into place by files.py alone, which fsyncs what it renames: no `os.replace`, `os.rename`,
  `Path.replace`, `Path.rename` or `shutil.move` elsewhere in the package.

Each rule reports every violation at once, by file and line; the last tests plant violations and check that each is
caught.
"""

from __future__ import annotations

import ast
from pathlib import Path

from support.paths import REPO
from test_imports import PACKAGE, fail_on, write_package

# Besides the package, where run folders are read: the benchmarks.
BENCH = "bench"
# Names the run folder shares with ordinary words of the package (a JSON field "model", the tracker "wandb"):
# spelled elsewhere for other things, so the rule cannot tell; run_folder.py still owns them as folder names.
ORDINARY_WORDS = {"model", "rng", "objective", "eval", "tensorboard", "wandb", ".tmp"}
# Pieces of a numbered name, before the number an f-string fills in.
NUMBERED_PREFIXES = ("step_", "set-aside-")
# What a pattern for a numbered name looks like, in a string literal.
NUMBERED_PATTERNS = (r"step_\d", r"step_(\d", r"set-aside-(\d", r"set-aside-\d")


def module_constants(path: Path, only: tuple[str, ...] | None = None) -> set[str]:
    """The string values of `path`'s module-level `NAME = "..."` assignments (those in `only`, when given)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return {node.value.value for node in tree.body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
            and (only is None or node.targets[0].id in only)}


def owned_names(root: Path, package: str) -> dict[str, set[str]]:
    """{owner file, from the root: the names only it may spell}."""
    folder = root / package
    return {f"{package}/run_folder.py": module_constants(folder / "run_folder.py") - ORDINARY_WORDS,
            f"{package}/files.py": module_constants(folder / "files.py", ("MARKER",))}


def not_names(tree: ast.AST) -> set[int]:
    """ids of the string constants that are not names on disk: docstrings, mapping keys (a dict's keys, a
    subscript, the key of `.get(key)`), and the pieces of f-strings (looked at as a whole)."""
    skipped = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body and \
                isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            skipped.add(id(body[0].value))
        elif isinstance(node, ast.JoinedStr):
            skipped.update(id(piece) for piece in node.values)
        elif isinstance(node, ast.Dict):
            skipped.update(id(key) for key in node.keys if key is not None)
        elif isinstance(node, ast.Subscript):
            skipped.add(id(node.slice))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and node.args:
            skipped.add(id(node.args[0]))
    return skipped


def spelled_names(path: Path, names: set[str], numbered: bool) -> list[tuple[int, str]]:
    """(line, what) for each of `names` that `path` spells itself and, with `numbered`, each numbered name it builds
    or matches."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    skipped = not_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skipped:
            if node.value in names:
                found.append((node.lineno, f"spells {node.value!r}"))
            elif numbered and any(pattern in node.value for pattern in NUMBERED_PATTERNS):
                found.append((node.lineno, f"spells the pattern {node.value!r}"))
        elif numbered and isinstance(node, ast.JoinedStr):
            for piece, following in zip(node.values, node.values[1:]):
                if isinstance(piece, ast.Constant) and isinstance(following, ast.FormattedValue) and \
                        str(piece.value).endswith(NUMBERED_PREFIXES):
                    found.append((node.lineno, f"builds a name from {piece.value!r}"))
    return found


def run_folder_names(root: Path, package: str) -> list[str]:
    """Every run-folder name spelled outside its owner, in the package and the benchmarks, by file and line."""
    owners = owned_names(root, package)
    problems = []
    for path in sorted(path for folder in (BENCH, package) for path in (root / folder).rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        names = set().union(*(owned for owner, owned in owners.items() if owner != relative))
        problems += [f"{relative}:{line} {what} (a run-folder name: ask run_folder.py, or files.py for the marker)"
                     for line, what in sorted(spelled_names(path, names, relative != f"{package}/run_folder.py"))]
    return problems


def renames(path: Path) -> list[tuple[int, str]]:
    """(line, call) for each rename `path` makes: os.replace / os.rename / os.renames / shutil.move, one of them
    imported by name, a `.rename(...)` of anything, and a `.replace(target)` with one argument (str.replace takes
    two)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    module_renames = {"os": ("replace", "rename", "renames"), "shutil": ("move",)}
    imported = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for alias in node.names if alias.name in module_renames.get(node.module or "", ())}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in imported:
            found.append((node.lineno, f"{func.id}()"))
        elif isinstance(func, ast.Attribute):
            owner = func.value.id if isinstance(func.value, ast.Name) else None
            if func.attr in module_renames.get(owner or "", ()):
                found.append((node.lineno, f"{owner}.{func.attr}()"))
            elif owner not in module_renames and (func.attr == "rename" and node.args or func.attr == "replace"
                                                  and len(node.args) == 1 and not node.keywords):
                found.append((node.lineno, f".{func.attr}()"))
    return found


def renames_outside_files(root: Path, package: str) -> list[str]:
    problems = []
    for path in sorted((root / package).rglob("*.py")):
        if path == root / package / "files.py":
            continue
        problems += [f"{path.relative_to(root).as_posix()}:{line} renames with {call} (write through files.py: it "
                     f"fsyncs the file and its folder)" for line, call in sorted(renames(path))]
    return problems


def test_run_folder_names_are_spelled_by_their_owner_alone():
    fail_on(run_folder_names(REPO, PACKAGE))


def test_files_are_renamed_by_files_py_alone():
    fail_on(renames_outside_files(REPO, PACKAGE))


# ---------------------------------------------------------------- the checkers on planted violations

def named(where: str, because: str, findings: list[str]) -> list[str]:
    """What a checker reports for each of `findings` ("line what") in the file `where`."""
    return [f"{where}:{finding} {because}" for finding in findings]


OWNERS = {
    "gpt4all_training/run_folder.py": """\
        STEP_PREFIX = "step_"
        FINAL_DIR = "final"
        MODEL_DIR = "model"
        """,
    "gpt4all_training/files.py": """\
        import os

        MARKER = "COMPLETE"
        OWNER_FILE = ".made-by"

        def atomic_write(tmp, path):
            os.replace(tmp, path)
        """,
}


def test_planted_run_folder_names_are_named_and_prose_and_keys_are_not(tmp_path):
    root = write_package(tmp_path, {**OWNERS, "bench/train_throughput.py": """\
        def outputs(out, step):
            return out / "final", out / f"step_{step}", {"final": out}
        """, "gpt4all_training/studio/runs.py": '''\
        """Reads final/ and step_N/ folders."""
        import re

        STEP = re.compile(r"^step_(\\d+)$")

        def info(folder, state, step):
            """The run's final/."""
            done = (folder / "final" / "COMPLETE").is_file()
            return {"final": done, "run": state.get("final"), "step": folder / f"step_{step}",
                    "help": f"give a step_N folder, not {folder}", "model": folder / "model"}
        '''})
    because = "(a run-folder name: ask run_folder.py, or files.py for the marker)"
    assert run_folder_names(root, PACKAGE) == named("bench/train_throughput.py", because, [
        "2 builds a name from 'step_'",
        "2 spells 'final'",
    ]) + named("gpt4all_training/studio/runs.py", because, [
        "4 spells the pattern '^step_(\\\\d+)$'",
        "8 spells 'COMPLETE'",
        "8 spells 'final'",
        "9 builds a name from 'step_'",
    ])


def test_planted_renames_are_named_and_str_replace_is_not(tmp_path):
    root = write_package(tmp_path, {**OWNERS, "gpt4all_training/training/final.py": """\
        import os
        import shutil
        from os import rename as move_into_place

        def save(tmp, folder, text, config):
            os.replace(tmp, folder)
            tmp.rename(folder)
            folder.replace(tmp)
            shutil.move(tmp, folder)
            move_into_place(tmp, folder)
            return text.replace("a", "b"), config.rename(columns={"a": "b"})
        """})
    assert renames_outside_files(root, PACKAGE) == named(
        "gpt4all_training/training/final.py", "(write through files.py: it fsyncs the file and its folder)", [
            "6 renames with os.replace()",
            "7 renames with .rename()",
            "8 renames with .replace()",
            "9 renames with shutil.move()",
            "10 renames with move_into_place()",
        ])
