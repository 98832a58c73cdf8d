"""The `gpt4all-training` command and the top-level scripts take the same arguments; the pins agree everywhere."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml
from conftest import PYTHON, REPO

from gpt4all_training.cli.main import COMMANDS

COMMAND = str(Path(PYTHON).parent / "gpt4all-training")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), cwd=REPO, capture_output=True, text=True, timeout=60)


def test_help_lists_every_subcommand():
    result = run(COMMAND, "--help")
    assert (result.returncode, result.stderr) == (0, "")
    listed = re.search(r"\{([a-z_,]+)\}", result.stdout).group(1).split(",")
    assert listed == list(COMMANDS)
    assert {"clean", "data", "train"} <= set(listed)
    for name, (_, help_text) in COMMANDS.items():
        assert " ".join(help_text.split()[:3]) in " ".join(result.stdout.split())  # each has its one-line help


def test_clean_script_and_subcommand_take_the_same_arguments():
    script, subcommand = run(PYTHON, "clean.py", "--help"), run(COMMAND, "clean", "--help")
    assert script.returncode == subcommand.returncode == 0
    assert script.stdout == subcommand.stdout
    for option in ("--output-dir", "--drop-ai-disclaimers", "--drop-refusals", "--min-response-chars", "inputs"):
        assert option in script.stdout


def pins(lines) -> dict[str, str]:
    found = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            found[name.lower()] = version
    return found


def test_env_yaml_pins_the_same_versions_as_requirements():
    requirements = pins((REPO / "requirements.txt").read_text().splitlines()
                        + (REPO / "requirements-dev.txt").read_text().splitlines())
    env = yaml.safe_load((REPO / "env.yaml").read_text())
    pip_section = next(item["pip"] for item in env["dependencies"] if isinstance(item, dict))
    assert pins(pip_section) == requirements
    assert "torch" in requirements and len(requirements) >= 15
    assert "python=3.11" in env["dependencies"]
