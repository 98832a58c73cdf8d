"""The `gpt4all-training` command."""

from gpt4all_training.cli.main import main, run_as_script

__all__ = ["main", "run_as_script"]
