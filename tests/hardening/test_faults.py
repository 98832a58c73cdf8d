"""Faults injected into real training processes: the data vanishing mid-run, a corrupt dataset, a read-only
output_dir, a NaN loss at step k (stop or skip), and one rank of a 2-process run dying or hanging."""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
import torch
from support.launch import explain, free_port
from support.models import weights
from support.outputs import assert_bitwise_equal_weights, exact_rows, metrics, step_dirs
from support.paths import PYTHON, REPO

from gpt4all_training import cli
from gpt4all_training.training.checkpoint import verify

from .harness import RUNNER, STEPS, error_lines, run_train, write_data

# Exec the rest of the command without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (prctl PR_CAPBSET_DROP; root
# keeps neither across exec), so file permissions bind root as they bind everyone else.
DROP_DAC = (PYTHON, "-c", "import ctypes, os, sys; libc = ctypes.CDLL(None, use_errno=True); "
            "[libc.prctl(24, cap, 0, 0, 0) == 0 or sys.exit(f'prctl: errno {ctypes.get_errno()}') for cap in (1, 2)]; "
            "os.execv(sys.argv[1], sys.argv[1:])")


def permissions_bind() -> tuple[str, ...]:
    """The prefix that makes file permissions apply to this user: none for a normal user, DROP_DAC for root (the
    test is skipped where root may not drop capabilities)."""
    if os.geteuid() != 0:
        return ()
    if subprocess.run([*DROP_DAC, "/bin/true"], capture_output=True).returncode != 0:
        pytest.skip("running as root without CAP_SETPCAP: file permissions cannot be made to apply")
    return DROP_DAC


# ---------------------------------------------------------------- the dataset

@pytest.mark.integration
@pytest.mark.slow
def test_data_deleted_and_truncated_mid_run_changes_nothing(hard_config, reference, dolly_rows, tmp_path):
    """Both splits are tokenised into memory-mapped Arrow before step 1, so the source files are not read again:
    deleting one and cutting the other in half before step 3 leaves the run bitwise equal to the reference."""
    data = write_data(tmp_path / "data", dolly_rows)
    out = tmp_path / "run"
    result = run_train(hard_config, out, f"dataset_path={data}", fault="data_vanishes:3", env={"FAULT_DATA": str(data)})
    assert result.returncode == 0, explain(result)
    assert sorted(p.name for p in data.iterdir()) == ["b_clean.jsonl"]  # the fault did happen
    with pytest.raises(json.JSONDecodeError):
        [json.loads(line) for line in (data / "b_clean.jsonl").read_text().splitlines()]
    assert exact_rows(out) == exact_rows(reference)
    assert_bitwise_equal_weights(out / "final", reference / "final")


@pytest.mark.integration
def test_truncated_dataset_file_at_start_is_one_line_naming_it(hard_config, dolly_rows, tmp_path):
    bad = tmp_path / "cut_clean.jsonl"
    text = "".join(json.dumps(row) + "\n" for row in dolly_rows[:5])
    bad.write_text(text[:-40])  # the fifth record cut mid-string, as a copy interrupted by a full disk leaves it
    result = run_train(hard_config, tmp_path / "run", f"dataset_path={bad}")
    assert result.returncode == 2, explain(result)
    assert error_lines(result.stderr) == [
        f"error: {bad}:5: not valid JSON (Unterminated string starting at); fix or remove the line"]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_truncated_file_in_a_dataset_folder_is_named(hard_config, dolly_rows, tmp_path, capsys):
    data = write_data(tmp_path / "data", dolly_rows)
    (data / "b_clean.jsonl").write_text((data / "b_clean.jsonl").read_text()[:-40])
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--config", str(hard_config), f"dataset_path={data}", f"output_dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 2
    [line] = error_lines(capsys.readouterr().err)
    assert str(data / "b_clean.jsonl") in line


# ---------------------------------------------------------------- output_dir

@pytest.mark.integration
def test_read_only_output_dir_fails_before_any_work(hard_config, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    out.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    try:
        result = run_train(hard_config, out, prefix=permissions_bind())
    finally:
        out.chmod(0o755)
    assert result.returncode == 2, explain(result)
    assert result.stderr.strip().splitlines()[-1:] == [
        f"error: output_dir {out}: not writable (Permission denied); fix its permissions or choose another "
        f"output_dir"]
    assert "Traceback" not in result.stderr
    assert "parameters:" not in result.stdout and "train:" not in result.stdout  # neither data nor model loaded
    assert list(out.iterdir()) == []


@pytest.mark.integration
@pytest.mark.slow
def test_output_dir_made_read_only_mid_run_fails_at_the_next_save_in_one_line(hard_config, tmp_path):
    """Appending to metrics.jsonl still works (the file's own permission); creating step_4.tmp/ does not."""
    out = tmp_path / "run"
    try:
        result = run_train(hard_config, out, "save_every=2", fault="read_only:3", env={"FAULT_OUTPUT": str(out)},
                           prefix=permissions_bind())
    finally:
        out.chmod(0o755)
    assert result.returncode == 1, explain(result)
    assert error_lines(result.stderr) == [
        f"error: step 4: could not write checkpoint {out / 'step_4'} ([Errno 13] Permission denied: "
        f"'{out / 'step_4.tmp'}'); the previous checkpoint {out / 'step_2'} is intact. Make output_dir writable, "
        f"then rerun with resume=auto"]
    assert "Traceback" not in result.stderr
    assert step_dirs(out) == ["step_2"] and verify(out / "step_2") is None
    assert [row["step"] for row in metrics(out)] == [1, 2, 3, 4]


# ---------------------------------------------------------------- a NaN loss at step k

def test_nan_policy_and_ddp_timeout_are_validated(hard_config):
    from gpt4all_training.config.loader import load_config
    from gpt4all_training.errors import UserError

    config = load_config(hard_config, ["nan_policy=skip", "ddp_timeout_s=90"])
    assert (config.nan_policy, config.ddp_timeout_s) == ("skip", 90)
    assert (load_config(hard_config).nan_policy, load_config(hard_config).ddp_timeout_s) == ("stop", None)
    with pytest.raises(UserError, match=r"^nan_policy: must be 'stop' or 'skip', got 'ignore'$"):
        load_config(hard_config, ["nan_policy=ignore"])
    with pytest.raises(UserError, match=r"^ddp_timeout_s: must be at least 1 \(or unset\), got 0$"):
        load_config(hard_config, ["ddp_timeout_s=0"])

@pytest.mark.integration
@pytest.mark.slow
def test_nan_at_step_k_stops_naming_it_and_keeps_the_checkpoint_before(nan_stopped, reference):
    result, out = nan_stopped
    assert result.returncode == 1, explain(result)
    assert error_lines(result.stderr) == [
        "error: step 4: the loss is nan; lower lr, check the data, or use float32"]
    assert "Traceback" not in result.stderr
    assert exact_rows(out) == exact_rows(reference)[:3]  # steps 1-3 as in the reference, then nothing
    assert step_dirs(out) == ["step_2"] and verify(out / "step_2") is None
    assert not (out / "final").exists()


@pytest.fixture(scope="module")
def skipped_run(hard_config, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path, str]:
    """NaN at step 4 with nan_policy skip, a checkpoint after every step, wandb (offline) next to metrics.jsonl, and
    an HF token in the environment. The run's caches (datasets, wandb) live in the test's folder, to be searched."""
    root = tmp_path_factory.mktemp("hard-nan-skip")
    token = "hf_" + secrets.token_hex(16)
    env = {"HF_TOKEN": token, "HF_DATASETS_CACHE": str(root / "datasets-cache"),
           **{key: str(root / "wandb-home") for key in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR")}}
    result = run_train(hard_config, root / "run", "nan_policy=skip", "save_every=1", "keep_last=",
                       "report_to=jsonl,wandb", fault="nan_loss:4", env=env)
    return result, root, token


@pytest.mark.integration
@pytest.mark.slow
def test_nan_at_step_k_is_skipped_and_counted(skipped_run, reference):
    result, root, _ = skipped_run
    out = root / "run"
    assert result.returncode == 0, explain(result)
    rows, expected = exact_rows(out), exact_rows(reference)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["skipped_steps"] for r in rows] == [0, 0, 0, 1, 0, 0]
    assert math.isnan(rows[3]["loss"]) and math.isnan(rows[3]["grad_norm"])
    # Steps 1-3 are the reference's; the schedule still advances through the skipped step.
    assert [{k: v for k, v in r.items() if k != "skipped_steps"} for r in rows[:3]] == expected[:3]
    assert [r["lr"] for r in rows] == [r["lr"] for r in expected]
    # No update at step 4: the weights and the optimiser state leave it as they entered it.
    assert_bitwise_equal_weights(out / "step_4" / "model", out / "step_3" / "model")
    state_3 = torch.load(out / "step_3" / "optimizer.pt", weights_only=True)["state"]
    state_4 = torch.load(out / "step_4" / "optimizer.pt", weights_only=True)["state"]
    assert all(torch.equal(state_3[i][k], state_4[i][k]) for i in state_3 for k in state_3[i])
    # ... and step 5 trains again from zeroed gradients (NaN ones kept would make every weight NaN).
    after = weights(out / "step_5" / "model")
    assert any(not torch.equal(after[k], v) for k, v in weights(out / "step_4" / "model").items())
    assert all(torch.isfinite(t).all() for t in weights(out / "final").values())
    assert all(math.isfinite(r["loss"]) for i, r in enumerate(rows) if i != 3)
    summary = (out / "report.html").read_text()
    assert "<tr><th>skipped_steps</th><td>1</td></tr>" in summary
    assert "nan" not in summary.split("<svg")[1].split("</svg>")[0].lower()  # the skipped step is not drawn


@pytest.mark.integration
@pytest.mark.slow
def test_hf_token_is_in_no_file_the_run_writes(skipped_run):
    """Checkpoints (config.yaml, state.json), metrics.jsonl, report.html, final/, wandb's offline run and its
    settings, the datasets cache, stdout and stderr: the token from HF_TOKEN is in none of them."""
    result, root, token = skipped_run
    assert result.returncode == 0, explain(result)
    written = [p for p in root.rglob("*") if p.is_file()]
    assert {"config.yaml", "metrics.jsonl", "report.html", "model.safetensors"} <= {p.name for p in written}
    assert any(p.suffix == ".wandb" for p in written) and any("datasets-cache" in p.parts for p in written)
    assert [p for p in written if token.encode() in p.read_bytes()] == []
    assert token not in result.stdout + result.stderr


# ---------------------------------------------------------------- one rank of two dies or hangs

def launch_two_ranks(config: Path, out: Path, *overrides: str, signal_name: str) -> list[subprocess.Popen]:
    """Two processes joined by gloo, started as two nodes' launchers would start them (no torchrun agent that would
    clean up after a dead rank): rank 1 sends itself SIG`signal_name` just before step 3."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "FAULT": "stop_rank:3", "FAULT_RANK": "1",
           "FAULT_SIGNAL": signal_name}
    command = [PYTHON, str(RUNNER), "--config", str(config), f"output_dir={out}", "batch_size=2", "max_steps=40",
               *overrides]
    return [subprocess.Popen(command, cwd=REPO, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]


def process_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def wait_until(condition, limit: float) -> float:
    """Poll `condition` every 0.1 s; return the monotonic time it first held (fail after `limit` seconds)."""
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.1)
    return time.monotonic()


@pytest.mark.integration
@pytest.mark.distributed
@pytest.mark.slow
def test_killed_rank_makes_the_other_exit_at_once_with_one_line(hard_config, tmp_path):
    rank0, rank1 = launch_two_ranks(hard_config, tmp_path / "run", signal_name="KILL")
    try:
        died = wait_until(lambda: rank1.poll() is not None, 240)
        exited = wait_until(lambda: rank0.poll() is not None, 60)
        out, err = rank0.communicate()
    finally:
        for process in (rank0, rank1):
            process.kill()
            process.communicate()
    assert rank1.returncode == -signal.SIGKILL
    assert rank0.returncode == 1, f"{out[-2000:]}\n{err[-3000:]}"
    print(f"rank 0 exited {exited - died:.1f} s after rank 1 died")  # shown with pytest -rP
    assert exited - died < 20  # gloo sees the dead peer's socket close at once
    [line] = error_lines(err)
    # gloo words it "Connection closed by peer" or "Read error [address]: Connection reset by peer" by timing.
    assert re.fullmatch(r"error: rank 0 of 2: another process of this run died or stopped answering \((Read error "
                        r"\S+: )?Connection (closed|reset) by peer( \S+)?\); find the first error in the other ranks' "
                        r"output, then rerun with resume=auto to continue from the last checkpoint", line), line
    assert "Traceback" not in err


@pytest.mark.integration
@pytest.mark.distributed
@pytest.mark.slow
def test_hung_rank_makes_the_other_exit_after_ddp_timeout_with_one_line(hard_config, tmp_path):
    """SIGSTOP keeps rank 1's sockets open, as a wedged GPU or a frozen node does: only the timeout can end rank 0."""
    timeout = 8  # long enough for rank 1 to wait out rank 0's tokenisation at main_process_first's barrier
    rank0, rank1 = launch_two_ranks(hard_config, tmp_path / "run", f"ddp_timeout_s={timeout}", signal_name="STOP")
    try:
        stopped = wait_until(lambda: rank1.poll() is None and process_state(rank1.pid) == "T", 240)
        exited = wait_until(lambda: rank0.poll() is not None, timeout + 60)
        out, err = rank0.communicate()
    finally:
        for process in (rank0, rank1):
            process.kill()
            process.communicate()
    assert rank0.returncode == 1, f"{out[-2000:]}\n{err[-3000:]}"
    print(f"rank 0 exited {exited - stopped:.1f} s after rank 1 stopped (ddp_timeout_s={timeout})")
    assert timeout - 1 < exited - stopped < timeout + 30
    [line] = error_lines(err)
    assert line == (f"error: rank 0 of 2: another process of this run died or stopped answering (Timed out waiting "
                    f"{timeout * 1000}ms for recv operation to complete); find the first error in the other ranks' "
                    f"output, then rerun with resume=auto to continue from the last checkpoint")
    assert "Traceback" not in err
