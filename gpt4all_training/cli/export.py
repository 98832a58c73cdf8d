"""`gpt4all-training export`: a checkpoint, final/ or adapter as a slim HF folder or one GGUF file."""

from __future__ import annotations

import argparse
import re
import time

from gpt4all_training.export.formats import FORMATS, all_dtypes, dtype_help, format_help
from gpt4all_training.export.hf import Exported, export_with_agreement


def shard_size(text: str) -> str:
    if not re.fullmatch(r"\d+(\.\d+)?\s*[KMG]i?B", text, flags=re.IGNORECASE):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 500MB or 2GB")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="source", required=True,
                        help="a step_N/ checkpoint, final/, an adapter folder, a model folder or a .gguf file")
    parser.add_argument("--to", required=True, help="output folder (created; must not hold files)")
    parser.add_argument("--format", choices=tuple(FORMATS), required=True, help=format_help())
    parser.add_argument("--dtype", choices=all_dtypes(), help=dtype_help())
    parser.add_argument("--base", help="base model for an adapter, overriding adapter_config.json (folder, Hub id "
                                       "or .gguf file)")
    parser.add_argument("--max-shard-size", type=shard_size, default="2GB",
                        help="hf: split weights into files of at most this size (default 2GB)")


def readable_size(size: float) -> str:
    """A file size in the largest unit (powers of 1000) that keeps it at least 1: 512 B, 3.4 KB, 105.5 MB."""
    if size < 1000:
        return f"{size:.0f} B"
    for unit in ("KB", "MB", "GB", "TB"):
        size /= 1000
        if size < 999.95 or unit == "TB":
            break
    return f"{size:.1f} {unit}"


def execute(args: argparse.Namespace) -> Exported:
    return export_with_agreement(args.source, args.to, args.format, args.dtype, args.base, args.max_shard_size)


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    exported = execute(args)
    for path in exported.files:
        print(f"{path}  {readable_size(path.stat().st_size)}")
    summary = f"exported {args.source} as {args.format} in {time.perf_counter() - started:.1f} s"
    print(f"{summary}; {exported.agreement.summary()}" if exported.agreement else summary)
    return 0
