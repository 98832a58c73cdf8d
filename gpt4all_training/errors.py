"""The exceptions the CLI prints as one line (UserError: exit 2; TrainingError: exit 1), and the pieces their lines
are made of: a file system's refusal, a failed write's reason and remedy, a value cut short."""

import errno
import reprlib
from typing import Any

# A write refused (permissions, a read-only filesystem) rather than one that ran out of room.
REFUSED_WRITE = (errno.EACCES, errno.EPERM, errno.EROFS)
# The file system's answers that are about the machine, not a bug: refused, or out of room (disk, quota, file size).
FILE_SYSTEM_REFUSALS = (*REFUSED_WRITE, errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class UserError(Exception):
    """A problem with the user's input (config, paths, data), not a bug. The message says what to do."""


class TrainingError(Exception):
    """The run cannot go on (a non-finite loss, a failed save): one line naming the step, exit code 1."""


def file_system_refusal(exc: OSError) -> UserError | None:
    """The one line for an OSError the file system gave (see FILE_SYSTEM_REFUSALS) that no caller reported more
    precisely; None for any other error, which keeps its traceback."""
    if exc.errno not in FILE_SYSTEM_REFUSALS:
        return None
    what = exc.filename or "a file"
    advice = ("check its permissions, or choose another path" if exc.errno in REFUSED_WRITE
              else "free disk space, then run again")
    return UserError(f"{what}: {exc.strerror or type(exc).__name__}; {advice}")


def write_failure(exc: BaseException, where: str = "output_dir") -> tuple[str, str]:
    """(the first line of why a write failed, what to do about it): make `where` writable when the write was
    refused, free disk space when it ran out of room (a full disk, a quota, a file-size limit)."""
    reason = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
    refused = getattr(exc, "errno", None) in REFUSED_WRITE
    return reason, f"make {where} writable" if refused else "free disk space"


def shown(value: Any) -> str:
    """`value` for an error line: repr, cut short (a YAML alias can make a list of millions from a few lines)."""
    short = reprlib.Repr()
    short.maxstring = short.maxother = 160
    short.maxlist = short.maxdict = 4
    short.maxlevel = 2
    return short.repr(value)
