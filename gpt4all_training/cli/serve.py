"""`gpt4all-training serve --model PATH`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) that decodes
concurrent requests together. Binds 127.0.0.1 unless told otherwise; the API key is read from the environment
variable that --api-key-env names, never from the command line, and never logged."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

import torch

from gpt4all_training.errors import UserError
from gpt4all_training.model.trained import DTYPES, open_model
from gpt4all_training.serving.app import ServeSettings, context_length, create_app, eos_ids
from gpt4all_training.serving.engine import Engine
from gpt4all_training.serving.guard import LOCAL_HOSTS

# SIGTERM: uvicorn stops accepting and waits this long for running requests to finish, then cancels the rest.
GRACEFUL_SHUTDOWN_S = 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ServeSettings(model_id="")
    parser.add_argument("--model", required=True,
                        help="a model folder, .gguf file, adapter folder, step_N/ checkpoint or Hub id; clients "
                             "name it by this same string")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key-env", metavar="VAR",
                        help="require `Authorization: Bearer <key>`, the key being the value of environment "
                             "variable VAR")
    parser.add_argument("--max-batch-size", type=int, default=defaults.max_batch_size,
                        help="rows decoded together (default %(default)s); a request with n > 1 takes n rows")
    parser.add_argument("--max-tokens-cap", type=int, default=defaults.max_tokens_cap,
                        help="largest max_tokens a request may ask for (default %(default)s)")
    parser.add_argument("--max-prompt-tokens", type=int, default=defaults.max_prompt_tokens,
                        help="longest prompt accepted, in tokens (default %(default)s)")
    parser.add_argument("--max-queue", type=int, default=defaults.max_queue,
                        help="requests that may wait for a place in the batch; more get 429 (default %(default)s)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when there is one")
    parser.add_argument("--log-prompts", action="store_true", help="include prompt text in the request log lines")


def api_key(variable: str | None, host: str) -> str | None:
    if variable is None:
        if host not in LOCAL_HOSTS:
            print(f"warning: serving on {host} without --api-key-env: anyone who reaches the port can use the model",
                  file=sys.stderr)
        return None
    key = os.environ.get(variable)
    if not key:
        raise UserError(f"--api-key-env: environment variable {variable} is not set (or empty); export the key in "
                        f"it before starting the server")
    return key


def check_address(host: str, port: int) -> None:
    """Bind host:port as uvicorn will, and let it go: a port in use (or an address not of this machine) is one line
    before the minutes of loading the model, not after."""
    if not 0 <= port <= 65535:
        raise UserError(f"--port {port}: must be between 0 and 65535")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise UserError(f"--host {host}: not an address this machine can serve on ({exc.strerror})") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
        try:
            probe.bind(address)
        except OSError as exc:
            raise UserError(f"--port {port}: cannot listen on {host}:{port} ({exc.strerror}); stop what uses it or "
                            f"choose another --port") from None


def run(args: argparse.Namespace) -> int:
    import uvicorn

    for option in ("max_batch_size", "max_tokens_cap", "max_prompt_tokens", "max_queue"):
        if getattr(args, option) < 1:
            raise UserError(f"--{option.replace('_', '-')}: must be at least 1, got {getattr(args, option)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device: cuda was asked for, and torch sees no CUDA device")
    settings = ServeSettings(model_id=args.model, max_batch_size=args.max_batch_size,
                             max_tokens_cap=args.max_tokens_cap, max_prompt_tokens=args.max_prompt_tokens,
                             max_queue=args.max_queue, api_key=api_key(args.api_key_env, args.host),
                             log_prompts=args.log_prompts, host=args.host)
    check_address(args.host, args.port)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, tokenizer = open_model(args.model, DTYPES[args.dtype], device)
    engine = Engine(model, tokenizer, eos_ids(model, tokenizer), settings.max_batch_size, settings.max_queue)
    app = create_app(engine, tokenizer, settings, context_length(model, tokenizer))
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    request_log = logging.getLogger("gpt4all_training.serving")
    request_log.addHandler(handler)
    request_log.setLevel(logging.INFO)
    request_log.propagate = False
    uvicorn.run(app, host=args.host, port=args.port, access_log=False, log_level="info",
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    return 0
