"""files.py, the crash-safe file pieces every writer uses: a write that fails leaves the previous file, a marker
that proves a folder whole (in both of its forms), a folder built beside its place that removes only itself, and
output locations checked before any work."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

from gpt4all_training.errors import UserError
from gpt4all_training.files import (atomic_write, load_tensors, make_own_folder, marker_problem, move, new_file,
                                    new_folder, remove_own_folder, replace_folder, save_tensors, sha256_file,
                                    writable_file, writable_folder, write_marker)


def test_a_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("previous\n")

    def lines():
        yield "first\n"
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        atomic_write(path, lines())
    assert path.read_text() == "previous\n" and sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl"]
    atomic_write(path, ["a\n", "b\n"])
    assert path.read_text() == "a\nb\n"
    atomic_write(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"


def test_a_new_file_never_replaces_one_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "upload.jsonl"
    with new_file(path, suffix=".partial") as out:
        out.write(b"first\n")
        assert [p.name for p in tmp_path.iterdir()] == [Path(out.name).name]
        assert Path(out.name).name.startswith(".upload.jsonl.") and out.name.endswith(".partial")
    assert path.read_bytes() == b"first\n"
    with pytest.raises(FileExistsError), new_file(path) as out:
        out.write(b"second\n")
    with pytest.raises(ValueError), new_file(tmp_path / "other.jsonl") as out:
        raise ValueError("a refused upload")
    assert path.read_bytes() == b"first\n" and [p.name for p in tmp_path.iterdir()] == ["upload.jsonl"]


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_a_written_file_takes_the_mode_the_umask_gives(tmp_path, umask, mode):
    previous = os.umask(umask)
    try:
        atomic_write(tmp_path / "f.txt", "x")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "f.txt").stat().st_mode) == mode


def test_a_marker_proves_the_folder_whole_and_names_what_changed(tmp_path):
    folder = tmp_path / "entry"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("a")
    (folder / "sub" / "b.bin").write_bytes(b"b" * 10)
    assert marker_problem(folder) == "no completion marker (the save was interrupted)"
    write_marker(folder)
    assert json.loads((folder / "COMPLETE").read_text()) == {
        "files": {"a.txt": sha256_file(folder / "a.txt"), "sub/b.bin": sha256_file(folder / "sub" / "b.bin")}}
    assert marker_problem(folder) is None
    (folder / "sub" / "b.bin").write_bytes(b"b" * 9)
    assert marker_problem(folder) == "sub/b.bin does not match its checksum (corrupted or truncated)"
    (folder / "sub" / "b.bin").unlink()
    assert marker_problem(folder) == "sub/b.bin is missing"
    (folder / "COMPLETE").write_bytes(b"\xff not json")
    assert marker_problem(folder) == "unreadable completion marker"


def test_a_marker_of_the_flat_form_still_verifies(tmp_path):
    """The tokenized-data cache wrote {name: digest} without the "files" level; such entries stay readable."""
    (tmp_path / "stats.json").write_text("{}")
    (tmp_path / "COMPLETE").write_text(json.dumps({"stats.json": sha256_file(tmp_path / "stats.json")}))
    assert marker_problem(tmp_path) is None
    (tmp_path / "stats.json").write_text("{} ")
    assert marker_problem(tmp_path) == "stats.json does not match its checksum (corrupted or truncated)"


def test_a_new_folder_lands_whole_or_removes_only_itself(tmp_path):
    target = tmp_path / "out"
    (tmp_path / "out.partial").mkdir()  # the user's, or another run's: never touched
    (tmp_path / "out.partial" / "theirs.txt").write_text("keep")
    with pytest.raises(RuntimeError):
        with new_folder(target) as partial:
            (partial / "half.txt").write_text("half")
            raise RuntimeError("killed midway")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.partial"]
    assert (tmp_path / "out.partial" / "theirs.txt").read_text() == "keep"
    with new_folder(target) as partial:
        (partial / "model.txt").write_text("whole")
    assert marker_problem(target) is None and (target / "model.txt").read_text() == "whole"


def test_a_new_folder_never_replaces_one_that_appeared_meanwhile(tmp_path):
    """Two writers of one target: the second finds the first's folder there and fails without touching it."""
    target = tmp_path / "out"
    with pytest.raises(OSError):
        with new_folder(target, marker=False) as partial:
            (partial / "second.txt").write_text("second")
            target.mkdir()
            (target / "first.txt").write_text("first")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert [p.name for p in target.iterdir()] == ["first.txt"]


def test_a_replaced_folder_holds_only_the_new_files_and_nothing_is_left_beside_it(tmp_path):
    folder, built = tmp_path / "final", tmp_path / "final.tmp"
    folder.mkdir()
    (folder / "old.txt").write_text("old")
    for name in ("new.txt", "sub/more.txt"):
        (built / name).parent.mkdir(parents=True, exist_ok=True)
        (built / name).write_text(name)
    replace_folder(built, folder)
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")) == ["new.txt", "sub", "sub/more.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    (built / "again.txt").parent.mkdir()
    (built / "again.txt").write_text("again")
    replace_folder(built, tmp_path / "fresh")  # nothing there yet
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "fresh"]
    assert (tmp_path / "fresh" / "again.txt").read_text() == "again"


def test_a_move_renames_into_another_folder(tmp_path):
    (tmp_path / "run_id").write_text("abc")
    (tmp_path / "set-aside-1").mkdir()
    move(tmp_path / "run_id", tmp_path / "set-aside-1" / "run_id")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["set-aside-1",
                                                                                      "set-aside-1/run_id"]
    assert (tmp_path / "set-aside-1" / "run_id").read_text() == "abc"


def test_a_working_folder_is_removed_only_when_this_program_made_it(tmp_path):
    theirs = tmp_path / "shards"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("the user's")
    with pytest.raises(UserError, match="exists and was not made by this program"):
        remove_own_folder(theirs, "output_dir")
    assert (theirs / "notes.txt").read_text() == "the user's"
    ours = make_own_folder(tmp_path / "work")
    (ours / "rank-0.parquet").write_bytes(b"x")
    remove_own_folder(ours, "output_dir")
    remove_own_folder(ours, "output_dir")  # nothing there: nothing to do
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards"]


def test_output_locations_are_checked_without_creating_anything(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:
        cases = [
            (lambda: writable_folder("--to", tmp_path / "file"), "is a file, not a folder"),
            (lambda: writable_folder("--to", tmp_path / "file" / "below"), f"{tmp_path / 'file'} is a file"),
            (lambda: writable_folder("--to", tmp_path / "full", new=True), "already exists and is not empty"),
            (lambda: writable_file("--dump", tmp_path / "full", example="d.jsonl"),
             f"is a folder; give a file path, e.g. {tmp_path / 'full' / 'd.jsonl'}"),
            (lambda: writable_file("--dump", "/proc/d.jsonl", example="d.jsonl"), "cannot write there"),
        ]
        if os.geteuid() != 0:  # root writes anywhere
            cases += [(lambda: writable_folder("--to", read_only / "new"), "cannot write there"),
                      (lambda: writable_file("--dump", read_only / "a" / "f.json", example="f"), "cannot write there")]
        for check, message in cases:
            with pytest.raises(UserError, match=message):
                check()
    finally:
        read_only.chmod(0o700)
    assert writable_folder("--to", tmp_path / "new" / "deeper", new=True) == tmp_path / "new" / "deeper"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "full", "read-only"]


def test_tensors_round_trip_and_a_pickle_of_code_is_refused(tmp_path):
    save_tensors({"w": torch.arange(3)}, tmp_path / "t.pt")
    assert torch.equal(load_tensors(tmp_path / "t.pt")["w"], torch.arange(3))
    torch.save({"f": Path("x")}, tmp_path / "code.pt")  # a class: unpickling it would construct an object
    with pytest.raises(UserError, match="holds objects other than tensors"):
        load_tensors(tmp_path / "code.pt")
