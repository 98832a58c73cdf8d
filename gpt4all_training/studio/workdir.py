"""The studio's one folder: every path a request or a config names is read relative to it and must stay inside it,
and uploads land in it, checked to be JSONL before they are kept.

A config's paths are found by its schema (`config.fields.path_values`: every field whose type is marked a local
path), so `Workdir.confine` checks a key added later too.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from pathlib import Path, PurePosixPath
from typing import AsyncIterator, TypeVar

from gpt4all_training.config.fields import path_values
from gpt4all_training.errors import UserError
from gpt4all_training.files import new_file

log = logging.getLogger("gpt4all_training.studio")

UPLOAD_SUFFIXES = (".jsonl",)
# An upload is streamed to `.NAME.RANDOM` + PARTIAL_SUFFIX beside its target; one left by a killed studio is removed
# when the studio starts again.
PARTIAL_SUFFIX = ".studio-upload"
# Where the studio puts what it makes (and models/, where a user puts base models); the pickers list these folders.
DATA_DIR, CONFIGS_DIR, RUNS_DIR, EXPORTS_DIR, EVAL_DIR, MAPS_DIR, MODELS_DIR = (
    "data", "configs", "runs", "exports", "eval", "maps", "models")


class OutsideWorkdir(UserError):
    """A path that leaves the workdir: the API answers 403."""


class Exists(UserError):
    """An upload to a name that is taken: the API answers 409."""


Config = TypeVar("Config")


class Workdir:
    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()

    def path(self, name: str, key: str = "path") -> Path:
        """The absolute path of `name` (relative to the workdir, or absolute inside it; `~` is the home folder, as
        the loaders read it). `..` anywhere, an absolute path outside, or a symbolic link that leads outside is
        refused with OutsideWorkdir naming `key`."""
        if not isinstance(name, str) or not name.strip() or "\x00" in name:
            raise UserError(f"{key}: give a path inside the workdir")
        if ".." in PurePosixPath(name.replace("\\", "/")).parts:
            raise OutsideWorkdir(f"{key} {name}: '..' is not allowed; give a path inside the workdir {self.root}")
        expanded = Path(os.path.expanduser(name))
        try:
            # resolve() follows symbolic links, so a link inside the workdir to a file outside is refused too.
            resolved = (self.root / expanded).resolve()  # an absolute `expanded` replaces the root
        except (OSError, RuntimeError) as exc:  # a loop of symbolic links, a folder that cannot be read
            raise UserError(f"{key} {name}: cannot be followed ({exc}); give a path inside the workdir") from None
        if resolved != self.root and self.root not in resolved.parents:
            raise OutsideWorkdir(f"{key} {name}: outside the workdir {self.root}; give a path inside it")
        return resolved

    def confine(self, config: Config) -> Config:
        """`config` (any config of config/schemas.py) once every local path it names is inside the workdir: model,
        tokenizer, data, outputs, reward modules, include paths, whatever its schema marks as a path."""
        for key, name in path_values(config):
            self.path(name, key)
        return config

    def inside(self, path: Path) -> bool:
        """Whether `path`, followed through symbolic links, is in the workdir (a warning in the log when not)."""
        try:
            resolved = path.resolve()
        except (OSError, RuntimeError) as exc:
            log.warning("skipped %s: cannot be followed (%s)", path, exc)
            return False
        if resolved == self.root or self.root in resolved.parents:
            return True
        log.warning("skipped %s: a symbolic link to %s, outside the workdir", path, resolved)
        return False

    def relative(self, path: str | Path) -> str:
        """How a page and a command line name `path`: relative to the workdir (the commands run from it)."""
        path = Path(path).resolve()
        return "." if path == self.root else path.relative_to(self.root).as_posix()

    def listing(self, folder: str, suffixes: tuple[str, ...] = (), folders: bool = False) -> list[str]:
        """Files under `folder` ending in one of `suffixes` (and, with `folders`, the folders), relative, sorted.
        A symbolic link that leads outside the workdir is left out, with a warning in the log."""
        base = self.root / folder
        if not base.is_dir() or not self.inside(base):
            return []
        found = []
        for path in sorted(base.rglob("*")):  # rglob lists a link to a folder, and does not go into it
            if path.is_symlink() and not self.inside(path):
                continue
            if path.is_dir() and folders or path.is_file() and path.name.endswith(suffixes) and suffixes:
                found.append(self.relative(path))
        return found

    async def upload(self, name: str, chunks: AsyncIterator[bytes]) -> dict[str, int | str]:
        """Write an uploaded JSONL file to `name`, a new file (the folders are created): streamed to a temporary
        file in the same folder (files.new_file), checked that every line is a JSON object, then linked to its name,
        which fails when the name was taken meanwhile (Exists: a concurrent upload of the same name), so an upload never
        replaces a file and a failed one leaves nothing behind. The body's size is bounded by the app."""
        target = self.path(name)
        if not target.name.endswith(UPLOAD_SUFFIXES):
            raise UserError(f"upload {name}: only JSONL files are taken (a name ending in .jsonl, one JSON object a "
                            f"line); convert the file first")
        taken = Exists(f"upload {name}: {self.relative(target)} exists; choose another name (an upload never "
                       f"replaces a file)")
        if target.exists():
            raise taken
        target.parent.mkdir(parents=True, exist_ok=True)
        size = 0
        try:
            with new_file(target, suffix=PARTIAL_SUFFIX) as out:
                fcntl.flock(out, fcntl.LOCK_EX)  # held while the file is in use: a studio starting meanwhile keeps it
                async for chunk in chunks:
                    size += len(chunk)
                    out.write(chunk)
                out.flush()
                lines = jsonl_lines(Path(out.name), name)
        except FileExistsError:
            raise taken from None
        return {"path": self.relative(target), "bytes": size, "lines": lines}

    def remove_partial_uploads(self) -> list[str]:
        """Remove what uploads cut short by a killed studio left (their temporary files, which no process holds);
        the paths removed, each also a warning in the log."""
        removed = []
        for folder, _, names in os.walk(self.root):  # does not follow links to folders
            for name in names:
                path = Path(folder) / name
                if not (name.startswith(".") and name.endswith(PARTIAL_SUFFIX)) or path.is_symlink():
                    continue
                try:
                    with open(path, "rb") as partial:
                        fcntl.flock(partial, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        path.unlink()
                except BlockingIOError:  # an upload of another studio on this workdir, still running
                    continue
                except OSError as exc:
                    log.warning("could not remove %s, left by an upload that was cut short (%s)", path, exc)
                    continue
                removed.append(self.relative(path))
                log.warning("removed %s: left by an upload that was cut short (the studio was killed)",
                            removed[-1])
        return removed


def jsonl_lines(path: Path, name: str) -> int:
    """The number of JSON-object lines in `path`; UserError naming the first line that is not one."""
    count = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8-sig" if number == 1 else "utf-8"))
            except ValueError:  # not UTF-8, not JSON, or a number too long for Python to read
                raise UserError(f"upload {name}: line {number} is not JSON; a JSONL file holds one JSON object a "
                                f"line") from None
            except RecursionError:
                raise UserError(f"upload {name}: line {number} is JSON nested too deeply to read; a JSONL file holds "
                                f"one JSON object a line") from None
            if not isinstance(record, dict):
                raise UserError(f"upload {name}: line {number} is a JSON {type(record).__name__}, not an object; a "
                                f"JSONL file holds one JSON object a line")
            count += 1
    if not count:
        raise UserError(f"upload {name}: the file holds no records")
    return count
