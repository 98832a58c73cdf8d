"""`python build_map.py ...` is `gpt4all-training build_map ...`; see gpt4all_training/cli/build_map.py."""

from gpt4all_training.cli.main import run_as_script

if __name__ == "__main__":
    run_as_script("build_map")
