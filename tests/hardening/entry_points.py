"""What the reliability property tests share: running one of our commands in this process and demanding one clean
error line, and a snapshot of a folder to prove that nothing the user had was changed."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from gpt4all_training.cli.main import main

from .harness import error_lines


def clean_failure(capsys, argv: list[str], code: int = 2) -> str:
    """Run the CLI with `argv` in this process: it must exit with `code` having printed exactly one error line on
    stderr and no traceback; returns the line. (A Python exception escaping `main` fails the test by itself.)"""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == code, err
    assert "Traceback" not in err
    [line] = error_lines(err)
    assert "\n" not in line
    return line


def snapshot(root: Path) -> dict[str, str]:
    """{path under root: its content's SHA-256, 'folder', or the link's target}, with each entry's mode: equal
    snapshots mean nothing was added, removed, rewritten or made read-only or writable."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            key = str(path.relative_to(root))
            mode = oct(path.lstat().st_mode)
            if path.is_symlink():
                out[key] = f"link {os.readlink(path)} {mode}"
            elif path.is_dir():
                out[key] = f"folder {mode}"
            else:
                out[key] = f"{hashlib.sha256(path.read_bytes()).hexdigest()} {mode}"
    return out
