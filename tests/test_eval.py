"""`gpt4all-training eval`: the harness's own scores on the models our loader opens, the offline suite, the
results file, the comparison, user mistakes as one line, and `eval_tasks` at the end of training.

The subprocesses of this module (our command, the harness's `lm_eval` command, the error cases and a short training
run with eval_tasks) start together in one fixture: each is single-threaded, and two of them index the harness's
14,000 task files (about 25 s of CPU each), so running them side by side keeps the module's wall time down.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from support.files import read_jsonl, write_config, write_jsonl
from support.paths import PYTHON, REPO
from gpt4all_training.config.schemas import TrainConfig
from gpt4all_training.errors import UserError
from gpt4all_training.evaluation.train_tasks import check_eval_tasks
from gpt4all_training.evaluation.harness import EvalSettings, evaluate, load_tasks, task_manager_for
from gpt4all_training.intervals import Comparison
from gpt4all_training.evaluation.results import comparison_rows, comparison_table, scores, tracker_metrics
from gpt4all_training.model.loading import load_model, load_tokenizer
from gpt4all_training.model.trained import describe, resolve

SUITE = REPO / "configs" / "eval"
LM_EVAL = str(Path(PYTHON).with_name("lm_eval"))
LIMIT, FEWSHOT = 6, 2
TRAIN_STEPS = 3
TIMEOUT_S = 600
PAIRS = [("What is two plus two?", "Four."), ("Name a colour.", "Red."), ("Say hello.", "Hello!"),
         ("Which animal barks?", "A dog.")]


def eval_command(*args: str) -> list[str]:
    return [PYTHON, "-m", "gpt4all_training.cli", "eval", *args]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> dict:
    """{name: (returncode, stdout, stderr, folder)} of every subprocess of the module, run side by side."""
    out = tmp_path_factory.mktemp("eval-runs")
    data = write_jsonl(out / "data" / "pairs_clean.jsonl",
                       [{"prompt": p, "response": r, "source": "t"} for p, r in PAIRS]).parent
    # LoRA with dropout: scoring on the way must leave the training mode and the random state as they were.
    training = {"model_name": str(tiny_model_dir), "dataset_path": str(data), "max_length": 64, "batch_size": 2,
                "max_steps": TRAIN_STEPS, "num_epochs": 2, "warmup_steps": 0, "val_fraction": 0.0, "eval_every": None,
                "save_every": None, "num_proc": 1, "report_to": ["jsonl"], "lora": True, "lora_r": 4,
                "lora_dropout": 0.5, "lr": 1e-2}
    train_config = write_config(out, {**training, "eval_tasks": ["gpt4all_arithmetic_choice"], "eval_tasks_limit": 4,
                                      "eval_include_path": str(SUITE), "eval_tasks_every": 1}, "eval_tasks.yaml")
    plain_config = write_config(out, training, "plain.yaml")
    common = ["--tasks", "gpt4all_offline", "--limit", str(LIMIT)]
    commands = {
        "ours": eval_command("--model", str(tiny_model_dir), *common, "--include-path", str(SUITE),
                             "--num-fewshot", str(FEWSHOT), "--output", str(out / "ours")),
        "harness": [LM_EVAL, "--model", "hf", "--model_args", f"pretrained={tiny_model_dir},dtype=float32",
                    *common, "--include_path", str(SUITE), "--num_fewshot", str(FEWSHOT), "--device", "cpu",
                    "--output_path", str(out / "harness")],
        "missing_file": eval_command("--model", str(tiny_model_dir), "--tasks", "configs/eval/no_such_task.yaml"),
        "unknown_task": eval_command("--model", str(tiny_model_dir), "--tasks", "gpt4all_no_such_task"),
        "train": [PYTHON, str(REPO / "train.py"), "--config", str(train_config), f"output_dir={out / 'train'}"],
        "train_plain": [PYTHON, str(REPO / "train.py"), "--config", str(plain_config), f"output_dir={out / 'plain'}"],
    }
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    logs = out / "logs"
    logs.mkdir()
    processes = {}
    for name, command in commands.items():
        with open(logs / f"{name}.out", "w") as stdout, open(logs / f"{name}.err", "w") as stderr:
            processes[name] = subprocess.Popen(command, cwd=REPO, env=env, stdout=stdout, stderr=stderr)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for process in processes.values():
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    return {name: (process.returncode, (logs / f"{name}.out").read_text(), (logs / f"{name}.err").read_text(), out)
            for name, process in processes.items()}


def completed(runs: dict, name: str) -> Path:
    code, stdout, stderr, out = runs[name]
    assert code == 0, f"{name}: exit {code}\n{stdout[-2000:]}\n{stderr[-3000:]}"
    return out


def assert_same_numbers(ours: dict, theirs: dict, where: str = "") -> None:
    assert ours.keys() == theirs.keys(), where
    for key, value in ours.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            assert math.isclose(value, theirs[key], rel_tol=1e-6, abs_tol=1e-9), f"{where}{key}: {value} {theirs[key]}"
        else:
            assert value == theirs[key], f"{where}{key}"


@pytest.mark.integration
@pytest.mark.slow
def test_eval_gives_the_harness_commands_scores(runs):
    out = completed(runs, "ours")
    completed(runs, "harness")
    ours = json.loads((out / "ours" / "results.json").read_text())
    [harness_file] = (out / "harness").rglob("results_*.json")
    theirs = json.loads(harness_file.read_text())
    assert ours["results"].keys() == {"gpt4all_arithmetic_choice", "gpt4all_last_word", "gpt4all_exact_match"}
    for task in ours["results"]:
        assert_same_numbers(ours["results"][task], theirs["results"][task], f"{task}: ")
    for key in ("versions", "n-shot", "n-samples"):
        assert ours[key] == theirs[key], key
    assert ours["n-shot"] == dict.fromkeys(ours["results"], FEWSHOT)
    run = ours["run"]
    assert run["model"]["weights"]["sha256"] and run["limit"] == LIMIT and run["dtype"] == "float32"
    assert run["seeds"] == {"python": 0, "numpy": 1234, "torch": 1234, "fewshot": 1234}
    assert run["chat_template"] is None and run["versions"]["lm_eval"] == "0.4.13"
    assert "gpt4all_arithmetic_choice" in runs["ours"][1] and "acc_norm" in runs["ours"][1]  # the table
    # Each example's value of every score that is a mean over examples (perplexity is not), which they average to.
    for task, metrics in ours["per_example"].items():
        for key, values in metrics.items():
            assert len(values) == LIMIT and sum(values.values()) / LIMIT == pytest.approx(ours["results"][task][key])
    assert ours["per_example"].keys() == ours["results"].keys()
    assert sorted(ours["per_example"]["gpt4all_last_word"]) == ["acc,none"]
    assert "95% intervals" in runs["ours"][1] and "score [95% interval]" in runs["ours"][1]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("name, says", [("missing_file", "configs/eval/no_such_task.yaml does not exist"),
                                        ("unknown_task", "unknown task 'gpt4all_no_such_task'")])
def test_a_missing_task_file_or_unknown_task_is_one_line(runs, name, says):
    code, _, stderr, _ = runs[name]
    assert code == 2
    assert len(stderr.strip().splitlines()) == 1 and stderr.startswith("error: --tasks: "), stderr
    assert says in stderr


@pytest.mark.integration
@pytest.mark.slow
def test_training_with_eval_tasks_scores_final_and_logs_the_scores(runs):
    run_dir = completed(runs, "train") / "train"
    results = json.loads((run_dir / "eval" / "results.json").read_text())
    assert results["run"]["model"]["path"] == str(run_dir / "final") and results["run"]["limit"] == 4
    rows = read_jsonl(run_dir / "metrics.jsonl")
    key = "harness/gpt4all_arithmetic_choice/acc"
    logged = [row for row in rows if key in row]
    # eval_tasks_every: 1 scores the model in training after steps 1 and 2; final/ is scored after the last.
    assert [row["step"] for row in logged] == list(range(1, TRAIN_STEPS + 1))
    assert logged[-1][key] == results["results"]["gpt4all_arithmetic_choice"]["acc,none"]
    assert all(0 <= row[key] <= 1 for row in logged)


@pytest.mark.integration
@pytest.mark.slow
def test_scoring_during_training_leaves_the_training_unchanged(runs):
    from safetensors.torch import load_file

    scored = load_file(completed(runs, "train") / "train" / "final" / "adapter_model.safetensors")
    plain = load_file(completed(runs, "train_plain") / "plain" / "final" / "adapter_model.safetensors")
    assert scored.keys() == plain.keys() and scored
    for name, tensor in scored.items():
        assert torch.equal(tensor, plain[name]), name
    assert any(tensor.abs().sum() > 0 for name, tensor in scored.items() if "lora_B" in name)  # it trained


# ---------------------------------------------------------------- in process: adapters, checkpoints, mistakes

@pytest.fixture(scope="module")
def adapter_and_merged(tiny_model_dir, tmp_path_factory) -> tuple[Path, Path]:
    """A LoRA adapter over the tiny model (B made non-zero, so it changes the scores' inputs) and its merge."""
    from peft import LoraConfig, get_peft_model

    folder = tmp_path_factory.mktemp("adapter")
    model = get_peft_model(load_model(str(tiny_model_dir)), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    model.save_pretrained(folder / "adapter")
    model.merge_and_unload().save_pretrained(folder / "merged")
    load_tokenizer(str(tiny_model_dir)).save_pretrained(folder / "merged")
    return folder / "adapter", folder / "merged"


def quick(model: str | Path, task: str = "gpt4all_arithmetic_choice") -> dict:
    return evaluate(str(model), EvalSettings(tasks=(task,), include_paths=(str(SUITE),), limit=4))


@pytest.mark.slow
def test_an_adapter_scores_as_its_merged_model(adapter_and_merged, tiny_model_dir):
    adapter, merged = adapter_and_merged
    over_base, as_merged = quick(adapter), quick(merged)
    for task, metrics in scores(over_base).items():
        for key, value in metrics.items():
            assert math.isclose(value, scores(as_merged)[task][key], rel_tol=1e-5), key
    assert over_base["run"]["model"]["weights"]["adapter_of"]["path"] == str(tiny_model_dir)
    # The same scores on the same examples: paired, they differ by nothing.
    [row] = [row for row in comparison_rows(over_base, as_merged) if row["metric"] == "acc,none"]
    assert row["paired"] == Comparison(0.0, 0.0, 0.0, 4, "no measurable difference")


@pytest.mark.slow
def test_a_checkpoint_scores_as_the_folder_of_its_weights(tiny_model_dir, tmp_path):
    step = tmp_path / "step_3"
    (step / "model").mkdir(parents=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):  # the weights, no tokenizer
        shutil.copy(tiny_model_dir / name, step / "model" / name)
    (step / "config.yaml").write_text(f"model_name: {tiny_model_dir}\n")
    paths = resolve(str(step))
    assert (paths.weights, paths.tokenizer) == (str(step / "model"), str(tiny_model_dir))
    assert scores(quick(step, "gpt4all_last_word")) == scores(quick(tiny_model_dir, "gpt4all_last_word"))
    assert describe(str(step))["tokenizer"]["path"] == str(tiny_model_dir)


def test_task_data_that_needs_the_hub_is_one_line_offline(tmp_path):
    (tmp_path / "hub_task.yaml").write_text(
        "task: needs_the_hub\ndataset_path: someone/not-downloaded\noutput_type: loglikelihood\n"
        "test_split: test\ndoc_to_text: '{{text}}'\ndoc_to_target: '{{text}}'\n")
    manager = task_manager_for(("needs_the_hub",), (str(tmp_path),))
    with pytest.raises(UserError, match="the data of task 'needs_the_hub' cannot be loaded"):
        load_tasks(manager, ("needs_the_hub",))


def test_training_checks_eval_tasks_before_it_starts(tmp_path):
    config = TrainConfig(model_name="m", dataset_path="d", eval_tasks=["gpt4all_last_word"],
                         eval_include_path=str(tmp_path / "missing"))
    with pytest.raises(UserError, match="^eval_include_path: .*missing is not a folder"):
        check_eval_tasks(config)
    config.eval_include_path = str(SUITE)
    check_eval_tasks(config)


def test_the_offline_suite_is_the_same_every_time_and_never_scores_a_fewshot_example():
    spec = importlib.util.spec_from_file_location("offline_suite", SUITE / "suite.py")
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    for load, key in ((suite.load_arithmetic_choice, "question"), (suite.load_last_word, "context"),
                      (suite.load_exact_match, "prompt")):
        first, again = load(), load()
        assert first["test"].to_list() == again["test"].to_list()
        assert len(first["test"]) == suite.TEST_SIZE
        assert not {row[key] for row in first["train"]} & {row[key] for row in first["test"]}
    assert {row["family"] for row in suite.load_exact_match()["test"]} == {
        "arithmetic", "unit_conversion", "reverse_word", "sort_numbers"}


def test_comparison_and_tracker_keys():
    before = {"results": {"t": {"alias": "t", "acc,none": 0.25, "acc_stderr,none": 0.1, "exact_match,strip": 0.5}}}
    after = {"results": {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.1, "exact_match,strip": 0.5},
                         "u": {"acc,none": 1.0}}}
    table = comparison_table(before, after).splitlines()  # no per-example values: the bare difference
    assert table[0].split() == ["task", "metric", "before", "[95%", "interval]", "after", "[95%", "interval]",
                                "difference", "[95%", "interval]:", "verdict"]
    assert table[2].split() == ["t", "acc", "none", "0.2500", "0.5000", "+0.2500"]
    assert table[4].split() == ["u", "acc", "none", "-", "1.0000", "-"]
    assert tracker_metrics(after) == {"harness/t/acc": 0.5, "harness/t/exact_match/strip": 0.5, "harness/u/acc": 1.0}
