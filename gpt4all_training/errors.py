"""The one exception type for mistakes a user can fix: the CLI prints it as one line and exits 2."""


class UserError(Exception):
    """A problem with the user's input (config, paths, data), not a bug. The message says what to do."""


class TrainingError(Exception):
    """The run cannot go on (a non-finite loss, a failed save): one line naming the step, exit code 1."""
