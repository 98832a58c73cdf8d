"""Faults while a run writes its outputs, and checkpoints that look whole but are not: a full disk or a read-only
remount under metrics.jsonl, a full disk while final/ is written, garbage weights behind a valid marker, a stray
streaming state, a signal during the last step, and credentials pasted into config values."""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from resume.harness import run_train as run_with_crash
from support.launch import explain
from support.outputs import assert_bitwise_equal_weights, exact_rows, metrics, step_dirs

from gpt4all_training.config.secrets import REDACTED, redact, scrub
from gpt4all_training.training.checkpoint import MARKER, latest_checkpoint, verify, write_marker

from .harness import error_lines, one_error_line, run_train
from .test_faults import permissions_bind


# ---------------------------------------------------------------- metrics.jsonl

@pytest.mark.integration
@pytest.mark.slow
def test_a_full_disk_under_metrics_jsonl_is_one_line(hard_config, tmp_path):
    out = tmp_path / "run"
    result = run_train(hard_config, out, fault="metrics_full:3", env={"FAULT_OUTPUT": str(out)})
    assert result.returncode == 1, explain(result)
    assert error_lines(result.stderr) == [
        f"error: step 3: could not write {out / 'metrics.jsonl'} ([Errno 27] File too large); free disk space, then "
        f"rerun with resume=auto to continue from the last checkpoint"]
    assert "Traceback" not in result.stderr
    assert [row["step"] for row in metrics(out)] == [1, 2]  # every row before the fault intact, none cut


@pytest.mark.integration
@pytest.mark.slow
def test_a_read_only_remount_under_metrics_jsonl_is_one_line(hard_config, tmp_path):
    out = tmp_path / "run"
    try:
        result = run_train(hard_config, out, fault="metrics_read_only:3", env={"FAULT_OUTPUT": str(out)},
                           prefix=permissions_bind())
    finally:
        out.chmod(0o755)
    assert result.returncode == 1, explain(result)
    assert error_lines(result.stderr) == [
        f"error: step 3: could not write {out / 'metrics.jsonl'} ([Errno 13] Permission denied: "
        f"'{out / 'metrics.jsonl'}'); make output_dir writable, then rerun with resume=auto to continue from the last "
        f"checkpoint"]
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------- final/

@pytest.mark.integration
@pytest.mark.slow
def test_a_full_disk_while_final_is_written_keeps_the_last_checkpoint_and_says_so(hard_config, reference, tmp_path):
    """Before: a SafetensorError traceback, and a final/ holding only config.json that nothing marked incomplete."""
    out = tmp_path / "run"
    failed = run_train(hard_config, out, "save_every=2", fault="final_full:0")
    assert failed.returncode == 1, explain(failed)
    [line] = error_lines(failed.stderr)
    assert line.startswith(f"error: step 6: could not write the final model {out / 'final'} (")
    assert line.endswith(f"); nothing was left in {out / 'final'}; the checkpoint {out / 'step_4'} is kept: "
                         f"resume=auto trains on from it and writes final/. Free disk space, then run again")
    assert "File too large" in line and "Traceback" not in failed.stderr
    assert not (out / "final").exists() and not (out / "final.tmp").exists()
    assert step_dirs(out) == ["step_2", "step_4"] and verify(out / "step_4") is None

    resumed = run_train(hard_config, out, "resume=auto", "save_every=2")
    assert resumed.returncode == 0, explain(resumed)
    assert f"resumed from {out / 'step_4'} at step 4" in resumed.stdout
    assert verify(out / "final") is None and (out / "final" / MARKER).is_file()
    assert exact_rows(out) == exact_rows(reference)
    assert_bitwise_equal_weights(out / "final", reference / "final")


@pytest.mark.integration
@pytest.mark.slow
def test_a_full_disk_while_final_is_written_without_checkpoints_says_the_weights_are_lost(hard_config, tmp_path):
    out = tmp_path / "run"
    failed = run_train(hard_config, out, fault="final_full:0")
    assert failed.returncode == 1, explain(failed)
    [line] = error_lines(failed.stderr)
    assert line.endswith(f"); nothing was left in {out / 'final'}; no checkpoint of this run exists, so its trained "
                         f"weights are lost; set save_every to keep checkpoints. Free disk space, then run again")
    assert not (out / "final").exists() and not (out / "final.tmp").exists()


def test_a_finished_runs_final_folder_lists_and_verifies_its_files(reference):
    assert verify(reference / "final") is None
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(
        yaml.safe_load((reference / "final" / MARKER).read_text())["files"])


# ---------------------------------------------------------------- checkpoints that look whole

def garble(path: Path, how: str) -> None:
    data = path.read_bytes()
    path.write_bytes(b"\xff" * 5000 if how == "garbage" else data[:len(data) // 2])


@pytest.mark.integration
@pytest.mark.parametrize("how", ["garbage", "cut in half"])
def test_garbage_weights_behind_a_valid_marker_are_skipped_on_resume_and_refused_by_export(checkpointed_run, tmp_path,
                                                                                          capsys, how):
    """The marker is recomputed over the garbled file, so only reading the safetensors header can tell."""
    out = shutil.copytree(checkpointed_run, tmp_path / "run")
    garble(out / "step_4" / "model" / "model.safetensors", how)
    (out / "step_4" / MARKER).unlink()
    write_marker(out / "step_4")
    said = []
    assert latest_checkpoint(out, said.append) == out / "step_2"
    [skipped] = said
    assert skipped.startswith(f"skipping checkpoint {out / 'step_4'}: model/model.safetensors is not readable "
                              f"safetensors (")
    reason = skipped.split(": ", 1)[1]
    export = ["export", "--from", str(out / "step_4"), "--to", str(tmp_path / "export"), "--format", "hf"]
    line = one_error_line(capsys, export)
    assert line == f"error: --from {out / 'step_4'}: {reason}; export another checkpoint"
    assert not (tmp_path / "export").exists()


@pytest.mark.integration
def test_a_stray_data_state_in_a_fine_tuning_checkpoint_is_one_line(hard_config, checkpointed_run, tmp_path, capsys):
    """A checkpoint of a run that does not stream, holding a stream's position (listed in its marker): loading it
    called a stream that is not there (AttributeError)."""
    out = shutil.copytree(checkpointed_run, tmp_path / "run")
    torch.save({"next_record": torch.tensor(3)}, out / "step_4" / "data_state.pt")
    (out / "step_4" / MARKER).unlink()
    write_marker(out / "step_4")
    assert one_error_line(capsys, ["train", "--config", str(hard_config), f"output_dir={out}",
                             f"checkpoint={out / 'step_4'}"]) == (
        f"error: checkpoint {out / 'step_4'}: holds data_state.pt, a streamed run's position, but this run does not "
        f"stream its data; resume it with the config it was written with (its config.yaml), or remove the stray file")


# ---------------------------------------------------------------- a signal during the last step

@pytest.mark.integration
@pytest.mark.slow
def test_sigterm_during_the_last_step_finishes_the_run_and_says_so(hard_config, reference, tmp_path):
    """Before: "writing a checkpoint", then no checkpoint, final/ and exit 0. Now it says what it does."""
    out = tmp_path / "run"
    result = run_with_crash(hard_config, out, "save_every=2", crash="SIGTERM:6", timeout=300)
    assert result.returncode == 0, explain(result)
    assert "SIGTERM received: this is the last step: finishing the run and writing final/ (send it again to stop " \
           "at once)" in result.stderr
    assert "writing a checkpoint" not in result.stderr
    assert ("SIGTERM came during the last step, so the run finished instead of stopping: final/ is written and the "
            "exit code is 0") in result.stdout
    assert step_dirs(out) == ["step_2", "step_4"]
    assert_bitwise_equal_weights(out / "final", reference / "final")


# ---------------------------------------------------------------- credentials

def test_redaction_hides_every_secret_inside_any_value(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_" + "a" * 20)
    monkeypatch.setenv("OTHER_API_KEY", "b" * 12)
    monkeypatch.setenv("SHORT_KEY", "1")  # too short to be a credential: left alone
    assert redact({"save_name": "org/hf_" + "a" * 20, "list": ["x" + "b" * 12], "n": 1, "flag": "1"}) == {
        "save_name": "org/***", "list": ["x***"], "n": 1, "flag": "1"}
    assert scrub("token hf_" + "a" * 20 + " and " + "b" * 12) == f"token {REDACTED} and {REDACTED}"


@pytest.mark.integration
@pytest.mark.slow
def test_a_token_pasted_into_other_fields_is_in_no_file_and_no_output(hard_config, tmp_path):
    token, key = "hf_" + secrets.token_hex(16), secrets.token_hex(12)
    out = tmp_path / "run"
    result = run_train(hard_config, out, "save_every=2", f"save_name=someone/{token}",
                       f"wandb_project_name=project-{key}", env={"HF_TOKEN": token, "MY_SERVICE_KEY": key})
    assert result.returncode == 0, explain(result)
    written = [p for p in out.rglob("*") if p.is_file()]
    assert [p for p in written if token.encode() in p.read_bytes() or key.encode() in p.read_bytes()] == []
    assert token not in result.stdout + result.stderr and key not in result.stdout + result.stderr
    saved = yaml.safe_load((out / "step_4" / "config.yaml").read_text())
    assert (saved["save_name"], saved["wandb_project_name"]) == ("someone/***", "project-***")
