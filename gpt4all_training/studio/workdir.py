"""The studio's one folder: every path a request names is read relative to it and must stay inside it, and uploads
land in it, bounded in size and checked to be JSONL before they are kept."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path, PurePosixPath
from typing import AsyncIterator

from gpt4all_training.errors import UserError

UPLOAD_SUFFIXES = (".jsonl",)
# Where the studio puts what it makes (and models/, where a user puts base models); the pickers list these folders.
DATA_DIR, CONFIGS_DIR, RUNS_DIR, EXPORTS_DIR, EVAL_DIR, MAPS_DIR, MODELS_DIR = (
    "data", "configs", "runs", "exports", "eval", "maps", "models")


class OutsideWorkdir(UserError):
    """A path that leaves the workdir: the API answers 403."""


class TooLarge(UserError):
    """An upload past the size limit: the API answers 413."""


class Workdir:
    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()

    def path(self, name: str, key: str = "path") -> Path:
        """The absolute path of `name` (relative to the workdir, or absolute inside it). `..` anywhere, an absolute
        path outside, or a symbolic link that leads outside is refused with OutsideWorkdir naming `key`."""
        if not isinstance(name, str) or not name.strip() or "\x00" in name:
            raise UserError(f"{key}: give a path inside the workdir")
        if ".." in PurePosixPath(name.replace("\\", "/")).parts:
            raise OutsideWorkdir(f"{key} {name}: '..' is not allowed; give a path inside the workdir {self.root}")
        path = Path(name) if Path(name).is_absolute() else self.root / name
        # resolve() follows symbolic links, so a link inside the workdir to a file outside is refused too.
        resolved = path.resolve()
        if resolved != self.root and self.root not in resolved.parents:
            raise OutsideWorkdir(f"{key} {name}: outside the workdir {self.root}; give a path inside it")
        return resolved

    def relative(self, path: str | Path) -> str:
        """How a page and a command line name `path`: relative to the workdir (the commands run from it)."""
        path = Path(path).resolve()
        return "." if path == self.root else path.relative_to(self.root).as_posix()

    def listing(self, folder: str, suffixes: tuple[str, ...] = (), folders: bool = False) -> list[str]:
        """Files under `folder` ending in one of `suffixes` (and, with `folders`, the folders), relative, sorted."""
        base = self.path(folder)
        if not base.is_dir():
            return []
        found = []
        for path in sorted(base.rglob("*")):
            if path.is_dir() and folders or path.is_file() and path.name.endswith(suffixes) and suffixes:
                found.append(self.relative(path))
        return found

    async def upload(self, name: str, chunks: AsyncIterator[bytes], limit: int) -> dict[str, int | str]:
        """Write an uploaded JSONL file to `name` (a new file; the folders are created): streamed to a temporary
        file in the same folder, refused past `limit` bytes or when a line is not a JSON object, and renamed into
        place only when whole and valid, so a failed upload leaves nothing behind."""
        target = self.path(name)
        if not target.name.endswith(UPLOAD_SUFFIXES):
            raise UserError(f"upload {name}: only JSONL files are taken (a name ending in .jsonl, one JSON object a "
                            f"line); convert the file first")
        if target.exists():
            raise UserError(f"upload {name}: {self.relative(target)} exists; choose another name")
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
        size = 0
        try:
            with os.fdopen(fd, "wb") as out:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > limit:
                        raise TooLarge(f"upload {name}: larger than the limit of {limit:,} bytes; start the studio "
                                       f"with a larger --max-upload-mb, or put the file in the workdir yourself")
                    out.write(chunk)
            lines = jsonl_lines(Path(tmp), name)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return {"path": self.relative(target), "bytes": size, "lines": lines}


def jsonl_lines(path: Path, name: str) -> int:
    """The number of JSON-object lines in `path`; UserError naming the first line that is not one."""
    count = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8-sig" if number == 1 else "utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                raise UserError(f"upload {name}: line {number} is not JSON; a JSONL file holds one JSON object a "
                                f"line") from None
            if not isinstance(record, dict):
                raise UserError(f"upload {name}: line {number} is a JSON {type(record).__name__}, not an object; a "
                                f"JSONL file holds one JSON object a line")
            count += 1
    if not count:
        raise UserError(f"upload {name}: the file holds no records")
    return count
