"""The `gpt4all-training` command: one subcommand per stage. Argument parsing only; the work is in the modules.

Each subcommand's options are its module's `add_arguments(parser)`, the one list of them: the studio builds the
command lines its pages show from the same parsers (`command_line`), parses them as the CLI does, and calls the same
`execute(args)` the subcommand's `run(args)` prints the result of.

A `UserError` anywhere below becomes one line on stderr and exit code 2, a `TrainingError` one line and exit
code 1; neither prints a traceback. Everything printed passes `config.secrets.scrub` (credentials show as ***). A
command whose models and data are all local runs offline (cli/offline.py).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any

from gpt4all_training.cli.offline import announce, go_offline_if_local
from gpt4all_training.config.secrets import scrubbed_output
from gpt4all_training.errors import TrainingError, UserError, file_system_refusal
from gpt4all_training.library_warnings import hide_unactionable_warnings
from gpt4all_training.training.stop import StoppedAtOnce

# subcommand -> (module, one-line help). Each module provides add_arguments(parser) and run(args) -> int; those the
# studio runs also execute(args), the work without the printing.
COMMANDS = {
    "clean": ("gpt4all_training.cli.clean", "normalise raw JSONL into prompt/response records and conversations"),
    "data": ("gpt4all_training.cli.data", "tokenise a dataset and show examples and statistics"),
    "train": ("gpt4all_training.cli.train", "fine-tune a model (run under python, accelerate launch or torchrun)"),
    "inference": ("gpt4all_training.cli.inference", "per-example loss and embeddings over the training data"),
    "build_map": ("gpt4all_training.cli.build_map", "an interactive HTML map of inference embeddings"),
    "curate": ("gpt4all_training.cli.curate", "a new dataset from an inference run: duplicates, loss outliers, picks"),
    "generate": ("gpt4all_training.cli.generate", "generate text from a trained model"),
    "export": ("gpt4all_training.cli.export", "export a checkpoint as a slim HF folder or a GGUF file"),
    "tokenizer": ("gpt4all_training.cli.tokenizer", "train a byte-level BPE tokenizer"),
    "plan": ("gpt4all_training.cli.plan", "print the step, memory and time arithmetic of a config"),
    "check": ("gpt4all_training.cli.check", "pre-flight checks before a long run"),
    "eval": ("gpt4all_training.cli.eval", "benchmark scores from lm-evaluation-harness"),
    "serve": ("gpt4all_training.cli.serve", "an OpenAI-compatible HTTP server with batched generation"),
    "studio": ("gpt4all_training.cli.studio", "a local web app: data, runs, the map, evaluation, chat and export"),
}


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """All subcommands are listed; only the selected one's module is imported (torch is slow to import)."""
    parser = argparse.ArgumentParser(prog="gpt4all-training", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        sub_parser.set_defaults(module=module)
        if name == selected:
            importlib.import_module(module).add_arguments(sub_parser)
    return parser


class CommandParser(argparse.ArgumentParser):
    """One subcommand's parser whose mistakes raise a UserError instead of exiting the process (argparse's documented
    way to change that): for a caller that is not the command line, the studio."""

    def error(self, message: str):
        raise UserError(f"{self.prog}: {message}")


def command_parser(name: str) -> CommandParser:
    module, help_text = COMMANDS[name]
    parser = CommandParser(prog=f"gpt4all-training {name}", description=help_text)
    importlib.import_module(module).add_arguments(parser)
    return parser


def options_of(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """A parser's positionals and options, in its order, without --help."""
    return [action for action in parser._actions if not isinstance(action, argparse._HelpAction)]


def arguments_of(parser: argparse.ArgumentParser, values: dict[str, Any]) -> list[str]:
    """The arguments after the subcommand that give `values` ({dest: value}), in the parser's order, as a user would
    type them: a value that is None, False, empty or the option's default is left out. A value outside an option's
    choices is a UserError naming its dest."""
    unknown = set(values) - {action.dest for action in options_of(parser)}
    if unknown:
        raise ValueError(f"{parser.prog}: no option {', '.join(sorted(unknown))}")
    argv: list[str] = []
    for action in options_of(parser):
        value = values.get(action.dest)
        if value is None or value is False or value == [] or action.option_strings and value == action.default:
            continue
        given = value if isinstance(value, list) else [value]
        allowed = list(action.choices or ())
        for item in given if allowed else ():
            if item not in allowed:
                said = " or ".join(allowed) if len(allowed) == 2 else f"one of {', '.join(allowed)}"
                raise UserError(f"{action.dest}: must be {said}, got {item!r}")
        if not action.option_strings:
            argv += [str(item) for item in given]
        elif action.nargs == 0:  # a flag: store_true
            argv.append(action.option_strings[0])
        elif isinstance(action, argparse._AppendAction):
            argv += [part for item in given for part in (action.option_strings[0], str(item))]
        else:
            argv += [action.option_strings[0], str(value)]
    return argv


def command_line(name: str, values: dict[str, Any]) -> tuple[list[str], argparse.Namespace]:
    """The command line `gpt4all-training NAME ...` that gives `values` ({dest: value}), and its arguments as the
    subcommand parses them: what its `execute(args)` takes."""
    parser = command_parser(name)
    argv = arguments_of(parser, values)
    return [name, *argv], parser.parse_args(argv)


def report_error(exc: Exception) -> None:
    """One line on stderr, on a line of its own: progress bars still drawn are closed first."""
    if "tqdm" in sys.modules:
        for bar in list(getattr(sys.modules["tqdm"].tqdm, "_instances", [])):
            bar.close()
    print(f"error: {exc}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with scrubbed_output():  # every line printed or logged from here on, ours or a library's, hides secrets
        code = run_command(argv)
    sys.exit(code)


def run_command(argv: list[str]) -> int:
    """The subcommand's exit code, with a UserError, TrainingError or file system refusal as its one line."""
    try:
        announce(go_offline_if_local(argv))  # before the subcommand's module imports transformers and datasets
        hide_unactionable_warnings()
        args = build_parser(argv[0] if argv else None).parse_args(argv)
        code = importlib.import_module(args.module).run(args)
    except UserError as exc:
        report_error(exc)
        code = 2
    except TrainingError as exc:
        report_error(exc)
        code = 1
    except KeyboardInterrupt as exc:
        print("interrupted", file=sys.stderr)
        code = exc.exit_code if isinstance(exc, StoppedAtOnce) else 130  # a second SIGTERM is still 143
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away; keep Python from complaining while it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    except OSError as exc:  # a full disk or a refused file that no stage reported itself: one line, not a traceback
        refusal = file_system_refusal(exc)
        if refusal is None:
            raise
        report_error(refusal)
        code = 2
    return code


def run_as_script(command: str) -> None:
    """Entry for the top-level scripts: `python train.py ARGS` == `gpt4all-training train ARGS`."""
    main([command, *sys.argv[1:]])
