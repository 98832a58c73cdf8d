"""Issue 28, classes 2 and 3: an output that exists as the wrong kind, cannot be written, or fills the disk is one line
before the work (or, found while writing, one line with the partial output removed); nothing the user had is touched;
a tool removes only what it made.

`OUTPUTS` lists every command that writes and each of its output arguments. Every one is given each bad location
that fits its kind (`bad_locations`): the other kind of thing already there, a path below a file, a folder where no
file can be created (/proc, which binds root too, and a read-only folder, with root's override of permissions
dropped), and for an output that must be new, a folder holding files. The commands' inputs name things that do not
exist, so a check that came after the work had started would fail with another line.
"""

from __future__ import annotations

import ctypes
import os
import resource
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import yaml
from support.inference_runs import write_inference_run

from .entry_points import clean_failure, snapshot


@contextmanager
def permissions_bind() -> Iterator[None]:
    """File permissions apply to this thread while inside: root's CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH are
    dropped from its effective set (and restored after). Skips where they cannot be."""
    if os.geteuid() != 0:
        yield
        return

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    if libc.capget(ctypes.byref(header), data) != 0:
        pytest.skip("capget failed: file permissions cannot be made to apply to root")
    saved = data[0].effective
    data[0].effective = saved & ~((1 << 1) | (1 << 2))
    if libc.capset(ctypes.byref(header), data) != 0:
        pytest.skip("capset failed: file permissions cannot be made to apply to root")
    try:
        yield
    finally:
        data[0].effective = saved
        assert libc.capset(ctypes.byref(header), data) == 0


# (command, output argument, kind: "folder", "new folder" (must not hold files) or "file")
OUTPUTS = [
    ("clean", "--output-dir", "folder"), ("data", "--dump", "file"), ("train", "output_dir", "folder"),
    ("inference", "output_dir", "folder"), ("tokenizer", "output_dir", "folder"),
    ("build_map", "--output", "file"), ("build_map", "--png", "file"), ("build_map", "--clusters-csv", "file"),
    ("curate", "--output", "folder"), ("export", "--to", "new folder"), ("eval", "--output", "folder"),
]
BAD = {"folder": ["a-file", "below-a-file", "proc", "read-only"],
       "new folder": ["a-file", "below-a-file", "proc", "read-only", "not-empty"],
       "file": ["a-folder", "below-a-file", "proc", "read-only"]}
CASES = [(command, flag, where) for command, flag, kind in OUTPUTS for where in BAD[kind]]


def bad_location(tmp_path: Path, where: str) -> Path:
    return {"a-file": tmp_path / "mine.txt", "a-folder": tmp_path / "my-folder",
            "below-a-file": tmp_path / "mine.txt" / "out", "proc": Path("/proc/gpt4all-out"),
            "read-only": tmp_path / "read-only" / "out", "not-empty": tmp_path / "my-folder"}[where]


def argv(command: str, flag: str, target: Path, tmp_path: Path) -> list[str]:
    """The command with inputs that do not exist (the work would fail on them first) and `target` as `flag`."""
    missing = tmp_path / "does-not-exist"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"model_name": str(missing / "model"), "dataset_path": str(missing / "data")}))
    option = [f"{flag}={target}"] if flag == "output_dir" else [flag, str(target)]
    return {
        "clean": ["clean", str(missing / "raw.jsonl"), *option],
        "data": ["data", "--config", str(config), *option],
        "train": ["train", "--config", str(config), *option],
        "inference": ["inference", "--config", str(config), *option],
        "tokenizer": ["tokenizer", f"dataset_path={missing / 'data'}", *option],
        "build_map": ["build_map", "--input", str(missing), "--output", str(tmp_path / "map.html"), *option],
        "curate": ["curate", "--input", str(missing), "--loss-above", "0.9", *option],
        "export": ["export", "--from", str(missing), "--format", "hf", *option],
        "eval": ["eval", "--model", str(missing), "--tasks", "gpt4all_offline", *option],
    }[command]


@pytest.mark.parametrize("command, flag, where", CASES, ids=[f"{c}-{f}-{w}" for c, f, w in CASES])
def test_an_output_that_cannot_be_written_is_one_line_before_any_work(tmp_path, capsys, command, flag, where):
    (tmp_path / "mine.txt").write_text("the user's file")
    (tmp_path / "my-folder").mkdir()
    (tmp_path / "my-folder" / "theirs.bin").write_bytes(b"the user's")
    (tmp_path / "read-only").mkdir()
    target = bad_location(tmp_path, where)
    command_line = argv(command, flag, target, tmp_path)
    before = snapshot(tmp_path)
    (tmp_path / "read-only").chmod(0o555)
    try:
        with permissions_bind():
            line = clean_failure(capsys, command_line)
    finally:
        (tmp_path / "read-only").chmod(0o755)
    assert line.startswith(f"error: {flag} {target}: "), line
    assert snapshot(tmp_path) == before


# ---------------------------------------------------------------- failures while writing

@contextmanager
def disk_full_after(size: int) -> Iterator[None]:
    """No file may grow past `size` bytes while inside (RLIMIT_FSIZE): a write beyond fails with EFBIG, "File too
    large", as it would with ENOSPC on a full disk (Python ignores SIGXFSZ, so the write returns the error)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_clean_on_a_full_disk_is_one_line_and_keeps_the_previous_output(tmp_path, capsys):
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(f'{{"prompt": "question {i}", "response": "answer {i} {"x" * 50}"}}\n'
                           for i in range(200)))
    out = tmp_path / "out"
    out.mkdir()
    (out / "raw_clean.jsonl").write_text("the previous output\n")
    before = snapshot(tmp_path)
    with disk_full_after(4096):
        line = clean_failure(capsys, ["clean", str(raw), "--output-dir", str(out)])
    assert line == f"error: {out / 'raw_clean.jsonl'}: File too large; free disk space, then run again"
    assert snapshot(tmp_path) == before


def test_a_map_on_a_full_disk_is_one_line_and_leaves_no_partial_file(tmp_path, capsys):
    rng = np.random.default_rng(0)
    run = write_inference_run(tmp_path / "run", rng.normal(size=(40, 8)), rng.uniform(1, 3, 40),
                              [f"prompt {i}" for i in range(40)])
    (tmp_path / "maps").mkdir()
    before = snapshot(tmp_path)
    with disk_full_after(2048):
        line = clean_failure(capsys, ["build_map", "--input", str(run), "--output", str(tmp_path / "maps" / "m.html"),
                                      "--layout", "pca"])
    assert line.startswith(f"error: {tmp_path / 'maps'}/") and line.endswith(": File too large; free disk space, "
                                                                              "then run again")
    assert snapshot(tmp_path) == before


def test_inference_leaves_a_shards_folder_it_did_not_make(tiny_model_dir, hard_data, tmp_path, capsys):
    """inference removed output_dir/shards/ whatever it held ("left by a crashed run"); now only one it made."""
    out = tmp_path / "inference"
    (out / "shards").mkdir(parents=True)
    (out / "shards" / "notes.txt").write_text("the user's")
    before = snapshot(tmp_path)
    line = clean_failure(capsys, ["inference", f"model_name={tiny_model_dir}", f"dataset_path={hard_data}",
                                  f"output_dir={out}", "num_proc=1", "max_length=128"])
    assert line == (f"error: output_dir: {out / 'shards'} exists and was not made by this program, which would "
                    f"write there; move it away or choose another output_dir")
    assert snapshot(tmp_path) == before
