"""The arguments every config-reading subcommand takes (`--config`, `key=value ...`), and the config keys in `--help`.

The keys are listed after the options, grouped by block, each with its default and its doc: the same text the
dataclass fields carry, so `--help` and the code cannot disagree.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import textwrap
import typing

import yaml

from gpt4all_training.config.blocks import Block
from gpt4all_training.config.fields import choices

DOC_INDENT = " " * 6
WIDTH = 100


def add_config_arguments(parser: argparse.ArgumentParser, cls: type, config_help: str, *, required: bool = False,
                         overrides_help: str = "key=value config overrides") -> None:
    """`--config FILE` and the trailing `key=value` overrides; the keys of `cls` go in the epilog of `--help`."""
    parser.add_argument("--config", required=required, help=config_help)
    parser.add_argument("overrides", nargs="*", help=overrides_help)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = config_keys_help(cls)


@functools.cache  # the same text for a class; tests that run many commands in one process build it once
def config_keys_help(cls: type[Block]) -> str:
    """Every key of the config `cls`, grouped by block: `key: default  [choices]`, then its doc, indented."""
    hints = typing.get_type_hints(cls)
    lines = ["config keys (in the --config YAML or as key=value; after the colon: the default):"]
    for title, fields in cls.groups():
        lines += ["", title]
        for f in fields:
            allowed = choices(hints[f.name])
            line = f"  {f.name}: {shown_default(f)}" + (f"  [{' | '.join(allowed)}]" if allowed else "")
            lines.append(line)
            lines += textwrap.wrap(f.metadata["doc"], WIDTH, initial_indent=DOC_INDENT, subsequent_indent=DOC_INDENT,
                                   break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines)


def shown_default(f: dataclasses.Field) -> str:
    """The default as it would be written in YAML; `(required)` or `(unset)` when there is none."""
    if f.metadata.get("required"):
        return "(required)"
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if value is None:
        return "(unset)"
    text = yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
    return text.removesuffix("...").strip()
