"""Credentials from the environment kept out of everything a run writes or prints.

A secret is the value of `HF_TOKEN` or of any environment variable whose name ends in `_TOKEN` or `_KEY`. A config
value holding one (a token pasted into `save_name`, say) is written as `***` to config.yaml, the trackers and
inference.json, and any error line or log line that would show it shows `***` instead.
"""

from __future__ import annotations

import os
from typing import Any

REDACTED = "***"
SECRET_SUFFIXES = ("_TOKEN", "_KEY")
# Shorter values (a flag such as SOME_KEY=1) are not credentials, and hiding them would garble every line.
MIN_SECRET_CHARS = 8


def secret_values() -> list[str]:
    """The secrets in the environment now, longest first (so a secret inside another is hidden whole)."""
    values = {value for name, value in os.environ.items()
              if (name == "HF_TOKEN" or name.upper().endswith(SECRET_SUFFIXES)) and len(value) >= MIN_SECRET_CHARS}
    return sorted(values, key=len, reverse=True)


def scrub(text: str, secrets: list[str] | None = None) -> str:
    """`text` with every secret replaced by ***."""
    for secret in secret_values() if secrets is None else secrets:
        text = text.replace(secret, REDACTED)
    return text


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
