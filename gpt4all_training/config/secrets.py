"""Credentials kept out of everything the project prints, logs or snapshots: the one mechanism, applied where text
leaves the program.

A secret is the value of `HF_TOKEN` or of any environment variable whose name ends in `_TOKEN` or `_KEY` (8
characters or more), and any text shaped like a well-known credential whether or not it is in the environment
(`TOKEN_PATTERNS`: Hugging Face, OpenAI and Anthropic, GitHub, GitLab, Slack, AWS access keys). Each is shown as
`***`:
- `scrub(text)`: a line; `redact(value)`: a config value, dict or list, as written to config.yaml, the trackers,
  inference.json, eval's results.json and an export's model card;
- `scrubbed_output()`: the CLI runs every command inside it, so every line the program prints on stdout or stderr
  (its own, its log handlers', tqdm's, a library's that writes to sys.stdout or sys.stderr) passes `scrub` on its way
  out, and so does every record logged through Python's logging, whichever file a handler writes it to (wandb's
  debug.log); `streams_beneath_scrubbing()` lets a library that copies what is printed (wandb) copy the scrubbed
  text. Text written straight to the file descriptors by native code, and other files third-party libraries write
  (see RELIABILITY.md), are beyond it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from typing import Any, Callable, Iterator, TextIO

REDACTED = "***"
SECRET_SUFFIXES = ("_TOKEN", "_KEY")
# Shorter values (a flag such as SOME_KEY=1) are not credentials, and hiding them would garble every line.
MIN_SECRET_CHARS = 8
# Credentials recognisable by their shape alone; long enough that no word, path or hash of ours matches. A token
# starts after any character that is not a letter or digit: a separator of a path or a name (`/ - . = _`) or a space
# (`\b` would miss one after `_`, a word character: `run_hf_...`), never in the middle of a word (the `sk-` of
# `disk-...`).
TOKEN_PATTERNS = re.compile("(?<![A-Za-z0-9])(?:" + "|".join([
    r"hf_[A-Za-z0-9]{30,}",  # Hugging Face
    r"sk-(?:proj-|ant-)?[A-Za-z0-9_-]{20,}",  # OpenAI, Anthropic
    r"gh[pousr]_[A-Za-z0-9]{30,}", r"github_pat_[A-Za-z0-9_]{30,}",  # GitHub
    r"glpat-[A-Za-z0-9_-]{20,}",  # GitLab
    r"xox[abprs]-[A-Za-z0-9-]{10,}",  # Slack
    r"AKIA[0-9A-Z]{16}(?![A-Za-z0-9])",  # AWS access key id
]) + ")")


def secret_values() -> list[str]:
    """The secrets in the environment now, longest first (so a secret inside another is hidden whole)."""
    values = {value for name, value in os.environ.items()
              if (name == "HF_TOKEN" or name.upper().endswith(SECRET_SUFFIXES)) and len(value) >= MIN_SECRET_CHARS}
    return sorted(values, key=len, reverse=True)


def scrub(text: str, secrets: list[str] | None = None) -> str:
    """`text` with every secret (of the environment, or `secrets` when given) and every token-shaped credential
    replaced by ***."""
    for secret in secret_values() if secrets is None else secrets:
        text = text.replace(secret, REDACTED)
    return TOKEN_PATTERNS.sub(REDACTED, text)


def redact(value: Any, secrets: list[str] | None = None) -> Any:
    """A copy of a config value (or a dict or list of them) with every secret inside a string replaced by ***."""
    secrets = secret_values() if secrets is None else secrets
    if isinstance(value, str):
        return scrub(value, secrets)
    if isinstance(value, dict):
        return {key: redact(item, secrets) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(item, secrets) for item in value]
    return value


class ScrubbedStream:
    """A text stream whose writes pass `scrub`; everything else (fileno, isatty, flush, encoding) is the stream's."""

    def __init__(self, stream: TextIO, secrets: list[str]):
        self.stream, self.secrets = stream, secrets

    def write(self, text: str) -> int:
        return self.stream.write(scrub(text, self.secrets))

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def scrubbing_records(make_record: Callable[..., logging.LogRecord],
                      secrets: list[str]) -> Callable[..., logging.LogRecord]:
    """A log record factory: `make_record`'s records with their message scrubbed, for every handler alike."""
    def make(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # arguments that do not fit the format: logging reports it when a handler emits the record
            return record
        hidden = scrub(message, secrets)
        if hidden != message:
            record.msg, record.args = hidden, None
        return record
    return make


@contextlib.contextmanager
def scrubbed_output() -> Iterator[None]:
    """sys.stdout, sys.stderr and every log record scrubbed while inside (with the environment's secrets as they are
    on entry)."""
    secrets = secret_values()
    streams = sys.stdout, sys.stderr
    make_record = logging.getLogRecordFactory()
    sys.stdout, sys.stderr = ScrubbedStream(sys.stdout, secrets), ScrubbedStream(sys.stderr, secrets)
    logging.setLogRecordFactory(scrubbing_records(make_record, secrets))
    try:
        yield
    finally:
        sys.stdout, sys.stderr = streams
        logging.setLogRecordFactory(make_record)


@contextlib.contextmanager
def streams_beneath_scrubbing() -> Iterator[None]:
    """sys.stdout and sys.stderr, where `scrubbed_output` wraps them, are the streams it writes to while inside. A
    library that wraps the streams' write to keep a copy of what is printed (wandb's console capture, as it is
    imported) then wraps those, beneath the scrubbing, and keeps the scrubbed text; wrapping the scrubbed streams, it
    would be handed each line as printed."""
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (s.stream if isinstance(s, ScrubbedStream) else s for s in streams)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = streams
