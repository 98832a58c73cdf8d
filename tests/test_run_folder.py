"""run_folder.py, the run folder's names and paths: checkpoints listed by their step's number, the output_dir above
any model a run wrote, and what resume=never moves out of a new run's way."""

from __future__ import annotations

from pathlib import Path

from gpt4all_training.run_folder import (RUN_OUTPUTS, building_step_folders, merged_folder, run_of,
                                         set_aside_checkpoint, step_folder, step_folders)


def test_step_folders_are_listed_by_number_and_their_partial_saves_apart(tmp_path):
    for step in (10, 9, 100):
        step_folder(tmp_path, step).mkdir()
    for name in ("step_12.tmp", "step_9.set-aside-1", "step_x", "final"):
        (tmp_path / name).mkdir()
    (tmp_path / "step_11").write_text("a file, not a checkpoint")
    assert [(step, folder.name) for step, folder in step_folders(tmp_path)] == [
        (9, "step_9"), (10, "step_10"), (100, "step_100")]
    assert [(step, folder.name) for step, folder in building_step_folders(tmp_path)] == [(12, "step_12.tmp")]
    assert step_folders(tmp_path / "missing") == []
    assert set_aside_checkpoint(tmp_path / "step_9", 2) == tmp_path / "step_9.set-aside-2"


def test_the_run_above_a_model_is_found_only_for_what_a_run_writes():
    run = Path("runs/chat")
    assert [run_of(path) for path in (step_folder(run, 4), run / "final", merged_folder(run))] == [run, run, run]
    assert [run_of(Path(name)) for name in ("runs/chat/merged", "models/final-v2", "runs/chat/step_4/model")] == [
        None, None, None]


def test_resume_never_moves_the_run_s_outputs_and_not_the_cache_or_the_studio_s_files():
    moved = ["step_4", "step_4.tmp", "step_4.set-aside-1", "final", "final.tmp", "run_id", "metrics.jsonl",
             "metrics.jsonl.tmp", "report.html", "tensorboard", "wandb", "wandb_run_id", "eval"]
    kept = ["tokenized", "studio.json", "studio_exit.json", "train.log", "set-aside-1", "finals", "step_x", "evals"]
    assert [name for name in moved + kept if RUN_OUTPUTS.match(name)] == moved
