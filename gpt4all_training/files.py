"""Crash-safe files: the one way this package writes a file or a folder that must never be seen half-written, proves
later that it is whole, checks an output location before the work, and loads tensors without running code.

- `atomic_file(path)` / `atomic_write(path, content)`: written to a temporary name in the same folder, fsynced,
  then renamed over `path` (a rename within one filesystem is atomic), so a crash or a full disk leaves either the
  previous file or the new one. The temporary file takes the mode the umask gives any new file, and is removed on
  failure. `new_file(path)`: the same for a file that must not replace one, linked to its name instead of renamed.
- `fsync_file`, `fsync_dir`, `fsync_tree`: flushed to the disk, the folder entries included (a rename is only
  durable once its folder is synced).
- `sha256_file`: the one content hash.
- `write_marker(folder)` / `marker_problem(folder)`: the `COMPLETE` marker written last into a folder, listing every
  file's SHA-256 as `{"files": {relative path: digest}}`, and the check that the folder still holds exactly that
  (a marker of the older flat form `{relative path: digest}` still verifies). Checkpoints, final/, the tokenized-data
  cache and exports carry it.
- `new_folder(folder)`: a folder built beside its final place under a name of its own and renamed into place when
  complete; on failure only what this call created is removed. `replace_folder(built, folder)`: a complete folder
  built beside `folder` swapped into its place, the old one deleted only once the new one is there. `move(path,
  target)`: a rename, made durable. Nothing else in the package renames a file or a folder.
  `make_own_folder` / `remove_own_folder`: a working folder at a fixed place, which carries a file saying this
  program made it, and is deleted only when it does. A tool deletes only what it made in this run, or what carries
  its mark.
- `writable_folder` / `writable_file`: an output location checked before the work that fills it, leaving no trace;
  `created_folder`: a run's output_dir made and checked before the run loads its data and model.
- `save_tensors` / `load_tensors`: torch.save whose failure is an OSError, and `torch.load(weights_only=True)` with a
  refused pickle as one line; `check_tensor_files` for a library's own files; `safetensors_problem`.

The lowest layer: it imports only `errors` (torch and safetensors lazily, where a function needs them).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import IO, Any, Iterable, Iterator, Union

from gpt4all_training.errors import UserError

MARKER = "COMPLETE"
OWNER_FILE = ".made-by-gpt4all-training"
HASH_CHUNK = 1 << 20
Content = Union[str, bytes, Iterable[str]]


# ---------------------------------------------------------------- durability

def fsync_file(path: str | Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(folder: str | Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Every file under `root`, then every folder (so the files' names are durable too)."""
    for path in sorted(root.rglob("*")):
        if path.is_file():
            fsync_file(path)
    for folder in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        fsync_dir(folder)


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------- one file

def umask() -> int:
    """The process's umask (reading it means setting it; it is set straight back)."""
    current = os.umask(0o022)
    os.umask(current)
    return current


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """A temporary path beside `path` to write to; on leaving the block it is fsynced and renamed to `path`. An
    exception inside the block (a full disk, Ctrl-C) removes it and leaves `path` as it was."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp's 0600 would hide the file from the group that reads it
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename is None:  # a failed write() names no file: name the target
            exc.filename = str(path)
        raise
    fsync_dir(path.parent)


def atomic_write(path: str | Path, content: Content) -> Path:
    """`content` (text, bytes, or pieces of text written one after another, for a file too big to hold) as `path`,
    whole or not at all. Text is UTF-8."""
    with atomic_file(path) as tmp:
        if isinstance(content, bytes):
            tmp.write_bytes(content)
        elif isinstance(content, str):
            tmp.write_text(content, encoding="utf-8")
        else:
            with open(tmp, "w", encoding="utf-8") as out:
                for piece in content:
                    out.write(piece)
    return Path(path)


@contextlib.contextmanager
def new_file(path: Path, prefix: str = ".", suffix: str = ".tmp") -> Iterator[IO[bytes]]:
    """A temporary file beside `path` (`PREFIX + NAME + .RANDOM + SUFFIX`), open for binary reading and writing; on
    leaving the block it is fsynced and linked to `path`, which unlike a rename never replaces a file:
    FileExistsError when `path` was taken meanwhile. It stays open until linked (a lock the caller takes on it is
    held throughout), and is removed whatever happens."""
    handle = tempfile.NamedTemporaryFile(prefix=f"{prefix}{path.name}.", suffix=suffix, dir=path.parent)
    with handle as out:  # deletes the temporary name on leaving, linked or not
        os.chmod(out.name, 0o666 & ~umask())
        yield out
        out.flush()
        os.fsync(out.fileno())
        os.link(out.name, path)
    fsync_dir(path.parent)


# ---------------------------------------------------------------- folders and their markers

def write_marker(folder: Path, name: str = MARKER) -> None:
    """`folder/name`, listing every other file under `folder` with its SHA-256; written last."""
    files = {str(p.relative_to(folder)): sha256_file(p) for p in sorted(folder.rglob("*"))
             if p.is_file() and p != folder / name}
    (folder / name).write_text(json.dumps({"files": files}, indent=1), encoding="utf-8")


def marker_files(folder: Path, name: str = MARKER) -> dict[str, str] | None:
    """{relative path: SHA-256} as the marker lists them; None when it cannot be read."""
    try:
        data = json.loads((folder / name).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # ValueError: not JSON, or not UTF-8
        return None
    files = data.get("files") if isinstance(data, dict) and isinstance(data.get("files"), dict) else data
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        return None
    return files


def marker_problem(folder: Path, name: str = MARKER) -> str | None:
    """None if `folder` holds its marker and every file it lists, unchanged (and every listed safetensors file
    readable); otherwise why not, in a few words."""
    if not (folder / name).is_file():
        return "no completion marker (the save was interrupted)"
    files = marker_files(folder, name)
    if files is None:
        return "unreadable completion marker"
    for relative, digest in files.items():
        path = folder / relative
        if not path.is_file():
            return f"{relative} is missing"
        if sha256_file(path) != digest:
            return f"{relative} does not match its checksum (corrupted or truncated)"
        if relative.endswith(".safetensors") and (problem := safetensors_problem(path)):
            return f"{relative} {problem}"
    return None


def safetensors_problem(path: Path) -> str | None:
    """Why the safetensors file cannot be read, or None. A checksum only says a file is what was written; a file
    garbled before its checksum was taken passes it."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as tensors:
            tensors.keys()
    except (SafetensorError, OSError) as exc:
        return f"is not readable safetensors ({(str(exc).splitlines() or [type(exc).__name__])[0][:120]})"
    return None


@contextlib.contextmanager
def new_folder(folder: Path, marker: bool = True) -> Iterator[Path]:
    """A fresh folder beside `folder` (`NAME.partial-<random>`, a name no other run and no user folder has) to fill;
    on leaving the block it gets its marker (unless `marker=False`), is fsynced, and is renamed to `folder`, which
    must then not exist or be an empty folder. On failure the fresh folder, and only it, is removed."""
    tmp = folder.with_name(f"{folder.name}.partial-{secrets.token_hex(4)}")
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if marker:
            write_marker(tmp)
        fsync_tree(tmp)
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
        os.rename(tmp, folder)  # fails, rather than replacing, where a folder with files appeared meanwhile
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(folder.parent)


def replace_folder(built: Path, folder: Path) -> None:
    """Put `built`, a complete folder filled beside `folder` (so on the same filesystem), in `folder`'s place:
    fsynced, then renamed. A `folder` already there is first renamed to `NAME.previous` (a rename cannot replace a
    folder that holds files) and deleted once `built` is in place, so a crash leaves the old folder or the new one,
    never a mix."""
    fsync_tree(built)
    if folder.exists():
        previous = folder.with_name(folder.name + ".previous")
        shutil.rmtree(previous, ignore_errors=True)
        os.replace(folder, previous)
        os.replace(built, folder)
        shutil.rmtree(previous)
    else:
        os.replace(built, folder)
    fsync_dir(folder.parent)


def move(path: Path, target: Path) -> None:
    """Rename `path` to `target` on the same filesystem (a file already at `target` is replaced), durably: both
    folders' entries are fsynced."""
    os.replace(path, target)
    fsync_dir(target.parent)
    if path.parent != target.parent:
        fsync_dir(path.parent)


# ---------------------------------------------------------------- working folders a run makes and removes

def make_own_folder(folder: Path) -> Path:
    """`folder`, new, with a file that says this program made it: what `remove_own_folder` asks before deleting."""
    folder.mkdir(parents=True)
    (folder / OWNER_FILE).write_text("made by gpt4all-training; removed by it when the work is done\n",
                                     encoding="utf-8")
    return folder


def remove_own_folder(folder: Path, key: str) -> None:
    """Remove `folder` if this program made it (a crashed run's leftover); leave anything else and say so. `key`
    names the setting that chose the place."""
    if not folder.exists():
        return
    if not (folder / OWNER_FILE).is_file():
        raise UserError(f"{key}: {folder} exists and was not made by this program, which would write there; move it "
                        f"away or choose another {key}")
    shutil.rmtree(folder)


# ---------------------------------------------------------------- output locations, checked before the work

def nearest_existing(path: Path) -> Path:
    return next(p for p in [path, *path.absolute().parents] if p.exists())


def can_create_in(folder: Path) -> str | None:
    """Why a file cannot be created in the existing folder `folder`, or None (tried for real: permissions, a
    read-only filesystem, ACLs and quotas all answer)."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def writable_folder(flag: str, path: str | Path, *, new: bool = False) -> Path:
    """`path` is a folder that exists or can be created, and files can be written in it. With `new` (a folder
    `new_folder` builds whole), it must not exist or be empty, and its parent must take the folder built beside it.
    Nothing is created: a refused command leaves no trace. A UserError naming `flag`."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path}: is a file, not a folder; choose another path")
    if new and path.is_dir() and any(path.iterdir()):
        raise UserError(f"{flag} {path}: already exists and is not empty; choose a new folder")
    location_problem(flag, path, path.parent if new else path)
    return path


def created_folder(key: str, path: Path) -> Path:
    """Create the folder `path` (a run's output_dir) and prove a file can be written in it: a read-only one would
    otherwise fail only at the first log line or checkpoint, after the data and model are loaded. A UserError naming
    `key`."""
    if path.exists() and not path.is_dir():
        raise UserError(f"{key} {path}: is a file, not a folder; choose another {key}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        problem = can_create_in(path)
    except OSError as exc:
        problem = exc.strerror or type(exc).__name__
    if problem is not None:
        raise UserError(f"{key} {path}: not writable ({problem}); fix its permissions or choose another {key}")
    return path


def writable_file(flag: str, path: str | Path, *, example: str) -> Path:
    """`path` names a file (not a folder) whose folder exists or can be created, and a file can be written there;
    `example` is a file name to suggest inside a folder given by mistake. Nothing is created. A UserError naming
    `flag`."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {path}: is a folder; give a file path, e.g. {path / example}")
    location_problem(flag, path, path.parent)
    return path


def location_problem(flag: str, path: Path, folder: Path) -> None:
    """A UserError when `folder` (the place `path` will be written in) is below a file, or cannot take a new file."""
    existing = nearest_existing(folder)
    if not existing.is_dir():
        raise UserError(f"{flag} {path}: {existing} is a file, not a folder; choose another path")
    if (problem := can_create_in(existing)) is not None:
        raise UserError(f"{flag} {path}: cannot write there ({problem}); choose another path")


# ---------------------------------------------------------------- tensors

def save_tensors(value: Any, path: Path) -> None:
    """torch.save through a buffer: a failed write (a full disk) then raises OSError with its errno, which callers
    report (torch's own writer raises a cryptic RuntimeError)."""
    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    with open(path, "wb") as f:
        f.write(buffer.getbuffer())


def check_tensor_files(folder: Path, allowed: list[type]) -> None:
    """Refuse the `.pt` files under `folder` (a library's own state, such as DeepSpeed's, which it reads with
    weights_only=False, running whatever code a pickle names) when one holds more than tensors, plain values and the
    `allowed` classes: each is opened by the weights-only unpickler first, memory-mapped, so this checks the
    structure without reading tensors."""
    import torch

    with torch.serialization.safe_globals([*allowed]):
        for path in sorted(folder.rglob("*.pt")):
            load_tensors(path, map_location="cpu", mmap=True)


def load_tensors(path: Path, map_location: str | None = None, mmap: bool = False) -> Any:
    """torch.load of a file of tensors and plain values only: a pickle that would construct anything else (and so
    could run code) is refused with a UserError naming the file, whatever its checksum says."""
    import torch

    try:
        return torch.load(path, weights_only=True, map_location=map_location, mmap=mmap)
    except pickle.UnpicklingError:
        raise UserError(f"checkpoint file {path}: holds objects other than tensors, and loading them could run code; "
                        f"refused. Use only checkpoints this program wrote") from None
