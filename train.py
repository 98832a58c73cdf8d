"""`python train.py ...` is `gpt4all-training train ...`; see gpt4all_training/cli/train.py."""

from gpt4all_training.cli.main import run_as_script

if __name__ == "__main__":
    run_as_script("train")
