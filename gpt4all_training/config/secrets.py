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
  out. Text written straight to the file descriptors by native code, and files third-party libraries write (see
  RELIABILITY.md), are beyond it.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from typing import Any, Iterator, TextIO

REDACTED = "***"
SECRET_SUFFIXES = ("_TOKEN", "_KEY")
# Shorter values (a flag such as SOME_KEY=1) are not credentials, and hiding them would garble every line.
MIN_SECRET_CHARS = 8
# Credentials recognisable by their shape alone; long enough that no word, path or hash of ours matches.
TOKEN_PATTERNS = re.compile("|".join([
    r"\bhf_[A-Za-z0-9]{30,}",  # Hugging Face
    r"\bsk-(?:proj-|ant-)?[A-Za-z0-9_-]{20,}",  # OpenAI, Anthropic
    r"\bgh[pousr]_[A-Za-z0-9]{30,}", r"\bgithub_pat_[A-Za-z0-9_]{30,}",  # GitHub
    r"\bglpat-[A-Za-z0-9_-]{20,}",  # GitLab
    r"\bxox[abprs]-[A-Za-z0-9-]{10,}",  # Slack
    r"\bAKIA[0-9A-Z]{16}\b",  # AWS access key id
]))


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


@contextlib.contextmanager
def scrubbed_output() -> Iterator[None]:
    """sys.stdout and sys.stderr scrubbed while inside (with the environment's secrets as they are on entry)."""
    secrets = secret_values()
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = ScrubbedStream(sys.stdout, secrets), ScrubbedStream(sys.stderr, secrets)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = streams
