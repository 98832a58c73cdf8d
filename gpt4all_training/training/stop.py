"""Stopping on a signal: finish the step, write a checkpoint, exit with 128 + the signal's number."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any, Protocol


class VotingBackend(Protocol):
    """What a stop asks the run's backend (backends/backend.py): whether any rank received the signal."""

    def any_rank(self, flag: bool) -> bool: ...


class StoppedAtOnce(KeyboardInterrupt):
    """A second signal: stop at once. A KeyboardInterrupt, so everything on the way out unwinds as for Ctrl-C, that
    carries the exit code of the signal that stopped the run (143 for SIGTERM, 130 for SIGINT)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum


class GracefulStop:
    """SIGTERM (a preempted instance) or SIGINT (Ctrl-C): finish the current step, write a checkpoint, then stop.

    A second signal stops at once (StoppedAtOnce, a KeyboardInterrupt). Either way the run exits with 128 + the
    number of the signal that stopped it (143 for SIGTERM, 130 for SIGINT), as a shell reports a process stopped by
    that signal, so a wrapper script does not mistake it for a finished run; the checkpoint makes `resume=auto`
    continue exactly. A signal during the run's last step lets the run finish instead (final/, exit 0), and says so.
    Used as a context manager, the previous handlers come back however the block ends.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: int | None = None
        self.last_step = False  # set by the loop: a signal during the run's last step lets the run finish instead
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def __enter__(self) -> GracefulStop:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None:
            self.close()
            raise StoppedAtOnce(signum)
        self.received = signum
        plan = ("this is the last step: finishing the run and writing final/" if self.last_step
                else "finishing this step and writing a checkpoint")
        # os.write, not print: a signal handler may run in the middle of another print.
        os.write(2, f"\n{signal.Signals(signum).name} received: {plan} (send it again to stop at once)\n".encode())

    def requested(self, backend: VotingBackend) -> bool:
        """Whether any rank got a signal; every rank must call it at the same step, since it is a collective."""
        return backend.any_rank(self.received is not None)

    @property
    def exit_code(self) -> int:
        return 128 + (self.received or signal.SIGTERM)

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.received or signal.SIGTERM).name

    def close(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
