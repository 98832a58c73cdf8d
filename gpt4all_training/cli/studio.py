"""`gpt4all-training studio`: a local web app over the same functions as the other subcommands (see
gpt4all_training/studio). Binds 127.0.0.1 unless told otherwise; the API key is read from the environment variable
that --api-key-env names, never from the command line, and never logged."""

from __future__ import annotations

import argparse
import errno
import os
import socket
from pathlib import Path

from gpt4all_training.cli.serve import api_key
from gpt4all_training.errors import UserError
from gpt4all_training.model.trained import DTYPES
from gpt4all_training.studio.app import StudioSettings, create_app

MIB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--workdir", default=".", help="the folder the studio reads and writes (default: the current "
                                                       "folder); every path it takes must be inside it")
    parser.add_argument("--api-key-env", metavar="VAR",
                        help="require the key held by environment variable VAR for every request (the page asks "
                             "for it once)")
    parser.add_argument("--max-upload-mb", type=int, default=1024, help="largest upload taken (default 1024)")
    parser.add_argument("--chat-dtype", choices=list(DTYPES), default="float32",
                        help="precision the chat panel loads models in")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="chat and evaluation device; default: cuda when "
                                                                  "there is one")


def require_free_port(host: str, port: int) -> None:
    """Refuse a port in use now, not after the studio has started loading."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        # As uvicorn binds: connections of a studio that just stopped (TIME_WAIT) do not hold the port.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            reason = "in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise UserError(f"--port {port}: cannot listen on {host}:{port} ({reason}); choose another port") from None


def run(args: argparse.Namespace) -> int:
    import uvicorn

    if args.max_upload_mb < 1:
        raise UserError(f"--max-upload-mb: must be at least 1, got {args.max_upload_mb}")
    workdir = Path(args.workdir)
    if workdir.exists() and not workdir.is_dir():
        raise UserError(f"--workdir {workdir}: is a file; give a folder")
    key = api_key(args.api_key_env, args.host)
    require_free_port(args.host, args.port)
    workdir.mkdir(parents=True, exist_ok=True)
    os.chdir(workdir)  # the commands the pages show run from the workdir, and so do the functions behind them
    settings = StudioSettings(workdir=Path.cwd(), host=args.host, api_key=key,
                              max_upload_bytes=args.max_upload_mb * MIB, chat_dtype=args.chat_dtype,
                              device=args.device, key_variable=args.api_key_env)
    print(f"studio: http://{args.host}:{args.port}/ (workdir {Path.cwd()})", flush=True)
    uvicorn.run(create_app(settings), host=args.host, port=args.port, access_log=False, log_level="info")
    return 0
