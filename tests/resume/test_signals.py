"""SIGTERM (a preempted instance) and SIGINT (Ctrl-C) finish the current step, write a checkpoint and exit with
128 + the signal; resuming then continues bitwise exactly."""

from __future__ import annotations

import os
import signal

import pytest
from support.launch import explain
from support.outputs import assert_same_run, exact_rows, step_dirs

from gpt4all_training.training.checkpoint import verify
from gpt4all_training.training.stop import GracefulStop, StoppedAtOnce

from .harness import TOTAL_STEPS, run_train


@pytest.mark.integration
@pytest.mark.slow
def test_sigterm_then_sigint_checkpoint_exit_and_resume_exactly(resume_config, reference, tmp_path):
    out = tmp_path / "run"
    stopped = run_train(resume_config, out, crash="SIGTERM:6")
    assert stopped.returncode == 128 + signal.SIGTERM, explain(stopped)
    assert "SIGTERM received: finishing this step and writing a checkpoint" in stopped.stderr
    assert "stopped by SIGTERM after step 6" in stopped.stdout
    assert "Traceback" not in stopped.stderr
    # step_6 is off the save_every=4 grid: written because of the signal, after step 6 and nothing more.
    assert step_dirs(out) == ["step_4", "step_6"] and verify(out / "step_6") is None
    assert exact_rows(out)[-1]["step"] == 6 and not (out / "final").exists()

    stopped = run_train(resume_config, out, "resume=auto", crash="SIGINT:17")
    assert stopped.returncode == 128 + signal.SIGINT, explain(stopped)
    assert f"resumed from {out / 'step_6'} at step 6" in stopped.stdout
    assert step_dirs(out) == ["step_8", "step_16", "step_17"] and verify(out / "step_17") is None

    resumed = run_train(resume_config, out, "resume=auto")
    assert resumed.returncode == 0, explain(resumed)
    assert f"resumed from {out / 'step_17'} at step 17" in resumed.stdout
    assert_same_run(out, reference, TOTAL_STEPS)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_second_signal_stops_at_once_with_its_exit_code(resume_config, tmp_path, name):
    """The same signal twice after step 2: the first asks for a checkpoint after the step, the second stops at once,
    before it is written; the exit code is still 128 + the signal (143 for SIGTERM, not Ctrl-C's 130)."""
    out = tmp_path / "run"
    stopped = run_train(resume_config, out, crash=f"{name}+{name}:2")
    assert stopped.returncode == 128 + getattr(signal, name), explain(stopped)
    assert "Traceback" not in stopped.stderr
    assert f"{name} received: finishing this step and writing a checkpoint" in stopped.stderr
    assert stopped.stderr.splitlines()[-1] == "interrupted"
    assert step_dirs(out) == [] and not (out / "final").exists()


def test_second_signal_stops_at_once_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    stop = GracefulStop()
    try:
        assert stop.received is None
        os.kill(os.getpid(), signal.SIGTERM)  # the first one only asks the loop to stop after this step
        assert (stop.received, stop.exit_code, stop.signal_name) == (signal.SIGTERM, 143, "SIGTERM")
        with pytest.raises(KeyboardInterrupt) as stopped:  # a KeyboardInterrupt: everything unwinds as for Ctrl-C
            os.kill(os.getpid(), signal.SIGINT)
        assert isinstance(stopped.value, StoppedAtOnce) and stopped.value.exit_code == 130  # the second's code
        assert signal.getsignal(signal.SIGTERM) is before  # the second signal already restored them
    finally:
        stop.close()
    assert signal.getsignal(signal.SIGTERM) is before
