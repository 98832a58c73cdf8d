"""`python data.py ...` is `gpt4all-training data ...`; see gpt4all_training/cli/data.py."""

from gpt4all_training.cli.main import run_as_script

if __name__ == "__main__":
    run_as_script("data")
