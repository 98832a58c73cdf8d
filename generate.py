"""`python generate.py ...` is `gpt4all-training generate ...`; see gpt4all_training/cli/generate.py."""

from gpt4all_training.cli.main import run_as_script

if __name__ == "__main__":
    run_as_script("generate")
