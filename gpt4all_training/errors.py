"""The one exception type for mistakes a user can fix: the CLI prints it as one line and exits 2."""

import errno

# A write refused (permissions, a read-only filesystem) rather than one that ran out of room.
REFUSED_WRITE = (errno.EACCES, errno.EPERM, errno.EROFS)


class UserError(Exception):
    """A problem with the user's input (config, paths, data), not a bug. The message says what to do."""


class TrainingError(Exception):
    """The run cannot go on (a non-finite loss, a failed save): one line naming the step, exit code 1."""


def write_failure(exc: BaseException) -> tuple[str, str]:
    """(the first line of why a write failed, what to do about it): make output_dir writable when the write was
    refused, free disk space when it ran out of room (a full disk, a quota, a file-size limit)."""
    reason = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
    refused = getattr(exc, "errno", None) in REFUSED_WRITE
    return reason, "make output_dir writable" if refused else "free disk space"
