"""`python clean.py ...` is `gpt4all-training clean ...`; see gpt4all_training/cli/clean.py."""

from gpt4all_training.cli.main import run_as_script

if __name__ == "__main__":
    run_as_script("clean")
