"""`python inference.py ...` (also under torchrun) is `gpt4all-training inference ...`; see
gpt4all_training/cli/inference.py."""

from gpt4all_training.cli.main import run_as_script

if __name__ == "__main__":
    run_as_script("inference")
