"""The third-party warnings a plain run prints that tell its user nothing to act on, hidden by their message, in this
one place. Each is listed with what prints it and why nothing can be done about it; every other warning, a library's
included, still prints.

`hide_unactionable_warnings` runs once at the start of every command (cli/main.py), before the libraries load.
"""

from __future__ import annotations

import logging
import re
import warnings

# (category, message regex, why it is noise): Python warnings, matched from the message's start.
WARNINGS = [
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated",
     "PEFT reads the property transformers renamed; this project calls neither"),
    (UserWarning, r"Could not find a config file in .* - will assume that the vocabulary was not modified",
     "PEFT, saving an adapter whose base is a packaged GGUF (smollm2) or a Hub id it cannot open, checks for added "
     "tokens; training here never adds any"),
]
# (logger, message regex, why it is noise): log records of libraries that log rather than warn.
LOG_RECORDS = [
    ("DeepSpeed", r"Setting accelerator to CPU\. If you have GPU or other accelerator, we were unable to detect it",
     "DeepSpeed, imported by accelerate and transformers whatever the backend, guesses its device at import; the "
     "run's own lines say which device it uses"),
]


class DropMessages(logging.Filter):
    """Drops the records whose message matches one of `patterns`."""

    def __init__(self, patterns: list[str]) -> None:
        super().__init__()
        self.pattern = re.compile("|".join(f"(?:{p})" for p in patterns))

    def filter(self, record: logging.LogRecord) -> bool:
        return self.pattern.match(record.getMessage()) is None


def hide_unactionable_warnings() -> None:
    """Hide WARNINGS and LOG_RECORDS (a logger's filter stays when the library configures that logger later)."""
    for category, message, _ in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    by_logger: dict[str, list[str]] = {}
    for name, message, _ in LOG_RECORDS:
        by_logger.setdefault(name, []).append(message)
    for name, patterns in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropMessages) for f in logger.filters):  # once, however often a process calls it
            logger.addFilter(DropMessages(patterns))
