"""What a run says while it runs and when it ends: every long phase draws a progress bar with its count n/N (reference
scoring, validation, merging, as training does), the end names final/merged/, a schedule whose warmup never ends is
said at the start, and the third-party warnings that tell the user nothing to act on are not printed."""

from __future__ import annotations

import logging
import re
import subprocess
import warnings

import pytest

from support.files import write_jsonl
from support.paths import PYTHON, REPO
from gpt4all_training.config.blocks import validate
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.library_warnings import LOG_RECORDS, WARNINGS, hide_unactionable_warnings

PAIRS = [("What is the capital of France?", "Paris.", "London, I think."), ("Name a primary colour.", "Red.", "A dog."),
         ("What is two plus two?", "Four.", "Five or so."), ("Say hello.", "Hello!", "No."),
         ("Which animal barks?", "A dog.", "A cat, usually."), ("What do bees make?", "Honey.", "Paper."),
         ("Opposite of hot?", "Cold.", "Warm, or hot."), ("Largest planet?", "Jupiter.", "The moon.")]
# What the libraries print, word for word (transformers' modeling_utils, PEFT's save_and_load, DeepSpeed's
# real_accelerator), for each entry of library_warnings in order.
PRINTED_WARNINGS = ["`is_gradient_checkpointing` is deprecated and will be removed in v6. Use "
                    "`is_activation_checkpointing` instead.",
                    "Could not find a config file in smollm2 - will assume that the vocabulary was not modified."]
PRINTED_LOG_RECORDS = ["Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."]


def bar(what: str, total: int) -> re.Pattern:
    """A tqdm line of `what`'s bar counting k/total (a bar under another erases itself when done, and a fast one may
    not draw its last count before that)."""
    return re.compile(rf"{re.escape(what)}: +\d+%\|[^|\r\n]*\| \d+/{total} \[")


@pytest.mark.integration
def test_reference_scoring_and_validation_draw_a_bar_with_their_count(tiny_model_dir, tmp_path, capsys):
    """dpo with the precomputed reference: 6 train and 2 validation pairs in batches of 2 are scored in 3 and 1
    batches before step 1, each with its bar; the validation at the last step draws its own (1 batch)."""
    from gpt4all_training.training.loop import train

    data = write_jsonl(tmp_path / "pairs" / "pairs_clean.jsonl",
                       [{"prompt": p, "chosen": c, "rejected": r, "source": "t"} for p, c, r in PAIRS]).parent
    summary = train(validate(TrainConfig(
        model_name=str(tiny_model_dir), dataset_path=str(data), output_dir=str(tmp_path / "run"), objective="dpo",
        max_length=48, batch_size=2, warmup_steps=0, val_fraction=0.25, max_steps=1, save_every=None, num_proc=1,
        seed=0, dtype="float32")))
    err = capsys.readouterr().err
    assert (summary["train_examples"], summary["val_examples"]) == (6, 2)
    assert bar("reference (train)", 3).search(err) and bar("reference (validation)", 1).search(err), err[-2000:]
    assert bar("validation", 1).search(err) and bar("training", 1).search(err), err[-2000:]
    assert err.index("reference (train): ") < err.index("reference (validation): ") < err.index("training: ")


@pytest.mark.integration
@pytest.mark.slow
def test_a_lora_run_says_its_warmup_never_ends_draws_the_merge_and_names_merged(tiny_model_dir, tmp_path):
    """`python train.py` with merge_lora and warmup_steps 3 over 2 steps: a note at the start (plan's line), the
    merge's bar, the last line naming final/merged/, and none of the hidden warnings on either stream."""
    data = write_jsonl(tmp_path / "data" / "pairs_clean.jsonl",
                       [{"prompt": p, "response": c, "source": "t"} for p, c, _ in PAIRS]).parent
    output = tmp_path / "run"
    result = subprocess.run([PYTHON, "train.py", "--config", "configs/train/finetune_tiny.yaml",
                             f"model_name={tiny_model_dir}", f"dataset_path={data}", f"output_dir={output}",
                             "lora=true", "merge_lora=true", "max_steps=2", "warmup_steps=3", "lr=1e-3",
                             "min_lr=1e-4", "batch_size=2", "val_fraction=0", "save_every=", "eval_every="],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout.splitlines()
    assert ("note: warmup_steps 3 leaves none of the run's 2 optimiser steps to decay in: the learning rate rises "
            "to 0.000667 (lr is 0.001) and never comes down to min_lr 0.0001; set warmup_steps=0") in out
    assert out[-1] == (f"final model: {output / 'final'}; merged model: {output / 'final' / 'merged'}; loss "
                       f"curves: {output / 'report.html'}")
    assert (output / "final" / "merged" / "config.json").is_file()
    assert bar("Unloading and merging model", 34).search(result.stderr) is not None, result.stderr[-2000:]
    for printed in PRINTED_WARNINGS[:1] + PRINTED_LOG_RECORDS:
        assert printed not in result.stdout + result.stderr


def test_the_listed_library_warnings_are_hidden_and_every_other_still_prints():
    """Each warning and log record library_warnings lists, as its library prints it, is dropped; another warning of
    the same category, and another record of the same logger, still print."""
    assert len(PRINTED_WARNINGS) == len(WARNINGS) and len(PRINTED_LOG_RECORDS) == len(LOG_RECORDS)
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hide_unactionable_warnings()
        hide_unactionable_warnings()  # a second call adds nothing
        for (category, _, _), message in zip(WARNINGS, PRINTED_WARNINGS):
            warnings.warn(message, category)
        warnings.warn("`max_length` is deprecated: set max_new_tokens", FutureWarning)
        warnings.warn("the tokenizer has no pad token", UserWarning)
    assert [str(w.message) for w in caught] == ["`max_length` is deprecated: set max_new_tokens",
                                               "the tokenizer has no pad token"]
    handler = Keep()
    for (name, _, _), message in zip(LOG_RECORDS, PRINTED_LOG_RECORDS):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        try:
            logger.warning(message)
            logger.warning("NCCL timeout: rank 1 did not answer")
        finally:
            logger.removeHandler(handler)
        assert len([f for f in logger.filters if type(f).__name__ == "DropMessages"]) == 1
    assert records == ["NCCL timeout: rank 1 did not answer"] * len(LOG_RECORDS)
