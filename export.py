"""`python export.py ...` is `gpt4all-training export ...`; see gpt4all_training/cli/export.py."""

from gpt4all_training.cli.main import run_as_script

if __name__ == "__main__":
    run_as_script("export")
