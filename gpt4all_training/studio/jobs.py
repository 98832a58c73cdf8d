"""The longer actions (a map, curation, evaluation, export) as jobs: each runs the package function the CLI calls, in
a thread of the studio, while the page polls its state. A job's outcome is its result or the CLI's one-line error;
what it writes stays in the workdir when the studio stops, and the job record itself is not kept."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from gpt4all_training.config.secrets import scrub
from gpt4all_training.errors import TrainingError, UserError

log = logging.getLogger("gpt4all_training.studio")


@dataclass
class Job:
    id: str
    kind: str
    commands: list[str]  # what the job does, as command lines a user would type from the workdir
    state: str = "running"  # running, done or failed
    log: list[str] = field(default_factory=list)
    result: Any = None
    error: Optional[str] = None
    started: float = field(default_factory=time.time)
    ended: Optional[float] = None

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "commands": self.commands, "state": self.state,
                "log": [scrub(line) for line in self.log], "result": self.result, "error": self.error,
                "started": self.started, "ended": self.ended}


class Jobs:
    def __init__(self) -> None:
        self.jobs: dict[str, Job] = {}

    def start(self, kind: str, commands: list[str], work: Callable[[Callable[[str], None]], Any]) -> Job:
        """Run `work(say)` in a thread; `say(line)` adds a line to the job's log."""
        job = Job(secrets.token_hex(6), kind, commands)
        self.jobs[job.id] = job

        def run() -> None:
            try:
                job.result = work(job.log.append)
                job.state = "done"
            except (UserError, TrainingError) as exc:
                job.error, job.state = f"error: {scrub(str(exc))}", "failed"
            except Exception as exc:  # a bug: the page says so in one line; the traceback goes to the studio's log
                log.exception("job %s (%s) failed", job.id, kind)
                job.error, job.state = f"error: {kind} failed ({type(exc).__name__}: {scrub(str(exc))[:300]})", \
                    "failed"
            job.ended = time.time()

        threading.Thread(target=run, name=f"job-{kind}", daemon=True).start()
        return job

    def get(self, job_id: str) -> Job:
        if job_id not in self.jobs:
            raise UserError(f"job {job_id}: no such job (jobs are forgotten when the studio restarts; their files "
                            f"stay in the workdir)")
        return self.jobs[job_id]
