"""`python -m gpt4all_training.cli SUBCOMMAND ...`: the form `accelerate launch` needs under XLA."""

from gpt4all_training.cli.main import main

main()
