"""The architecture matrix: every family people fine-tune (tests/support/families.py), end to end on a tiny model
built from its config, in this process (the CLI and subprocess paths of each stage are tested in their own files).

Per family, few runs feed many cells, each made on first use and kept for the module (Runs): a LoRA run (3 steps, a
checkpoint at step 2, merged at the end) is resumed from its checkpoint and gives the merge, generate, serve, eval,
inference and HF export their model; a full run is repeated packed; a DPO run starts from the base. Every cell
asserts values (a loss against an independent computation, weights bitwise or within float rounding, replies against
transformers' own generate), and what it observed, "passes" or the one line it was refused with, must equal
docs/models.json (support/observations.py), from which scripts/models_table.py renders the README's table. GGUF
export is observed by tests/test_gguf.py, which writes every type for every family; GPT-J's refusal is observed here.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from support.conversations import SYSTEM, TOPICS, write_conversations
from support.families import FAMILIES, build_family_model
from support.files import write_jsonl
from support.observations import COMMITTED, GGUF_FAMILIES, forget, observe, table_script
from support.outputs import assert_bitwise_equal_weights, exact_rows, max_weight_difference, metrics
from support.paths import REPO
from gpt4all_training.config.blocks import validate
from gpt4all_training.config.schemas import InferenceConfig, TrainConfig
from gpt4all_training.errors import UserError

MAX_LENGTH = 64
LORA_STEPS, FULL_STEPS = 3, 2
FULL_LR = 1e-3
# The linear layers of each architecture but its output head: what LoRA adapts unless told otherwise.
ATTENTION_MLP = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
LINEAR_LAYERS = {**dict.fromkeys(("llama3", "qwen2.5", "qwen3", "mistral", "gemma2", "gemma3", "smollm2", "smollm3"),
                                 ATTENTION_MLP),
                 "phi3": ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"],
                 "pythia": ["dense", "dense_4h_to_h", "dense_h_to_4h", "query_key_value"],
                 "gptj": ["fc_in", "fc_out", "k_proj", "out_proj", "q_proj", "v_proj"]}
# Families whose GGUF cell this module observes: those tests/test_gguf.py has no file for.
GGUF_HERE = ["gptj"]
PREFERENCES = [{"prompt": question, "chosen": first, "rejected": second, "source": "t"}
               for question, first, second in TOPICS]
# Two conversations of different lengths: decoded together, the shorter one is left-padded.
CONVERSATIONS = [[{"role": "user", "content": "Name a colour."}],
                 [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a planet, please."}]]
NEW_TOKENS = 8
# Two float32 computations of one quantity in another order (another batch layout, the adapter's two matmuls against
# their merged sum) differ by rounding: each reduction rounds by about float32's epsilon relative to its size, and
# 2 layers and a softmax carry a few of them to the result. Measured at most 6.5 eps (Gemma 2's merge, where the
# soft-capping's tanh adds its own); 32 eps leaves room.
ROUNDING = 32 * torch.finfo(torch.float32).eps
# Adam divides each gradient by its own running size, so where a gradient is tiny a rounding-level difference moves
# that weight's step by a visible part of lr: measured at most 0.9% of lr after 2 steps; a twentieth is the bound.
PACKED_WEIGHTS = 0.05
EVAL_TASK = "gpt4all_arithmetic_choice"
SOURCE = "matrix"


@pytest.fixture(scope="module", autouse=True)
def fresh_observations():
    """This run's observations only, whichever families and cells it runs."""
    forget(SOURCE)


def test_the_readme_table_is_rendered_from_the_committed_results():
    """docs/models.json has every family and cell, some test observes each cell, and the README's table is what the
    script renders from it."""
    assert sorted([*GGUF_FAMILIES.values(), *GGUF_HERE]) == sorted(FAMILIES)
    script = table_script()
    data = json.loads(COMMITTED.read_text(encoding="utf-8"))
    assert list(data["families"]) == list(FAMILIES)
    for family, (name, features) in FAMILIES.items():
        entry = data["families"][family]
        assert (entry["name"], entry["features"]) == (name, features)
        assert list(entry["cells"]) == list(script.COLUMNS)
        assert all(outcome == "passes" or outcome.startswith("refused: ") for outcome in entry["cells"].values())
    readme = script.README.read_text(encoding="utf-8")
    assert script.with_table(readme, script.render(data)) == readme, "run scripts/models_table.py"


# ---------------------------------------------------------------- the tiny models and their data

@pytest.fixture(scope="session")
def family_folders(chat_tokenizer, tmp_path_factory) -> dict[str, Path]:
    """Every family's tiny model saved as a local model folder with the session's chat tokenizer (ChatML)."""
    root = tmp_path_factory.mktemp("families")
    for family in FAMILIES:
        build_family_model(family, chat_tokenizer).save_pretrained(root / family)
        chat_tokenizer.save_pretrained(root / family)
    return {family: root / family for family in FAMILIES}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("matrix-data")
    return {"chat": write_conversations(root / "chat"),
            "pairs": write_jsonl(root / "pairs" / "pairs_clean.jsonl", PREFERENCES).parent}


def run_config(model: Path, data: Path, output: Path, **overrides) -> TrainConfig:
    """One step sees all 8 examples, so a step's loss is the whole dataset's. fp32, not `auto`: the cells' bounds are
    multiples of fp32's epsilon."""
    values = dict(model_name=str(model), dataset_path=str(data), output_dir=str(output), max_length=MAX_LENGTH,
                  dtype="float32",
                  batch_size=8, lr=1e-2, min_lr=1e-2, warmup_steps=0, val_fraction=0.0, num_epochs=10,
                  eval_every=None, save_every=None, num_proc=1, seed=0, report_to=["jsonl"])
    return validate(TrainConfig(**{**values, **overrides}))


def train(config: TrainConfig) -> dict:
    from gpt4all_training.training.loop import train as run

    return run(config)


def losses(output: Path) -> list[float]:
    return [row["loss"] for row in metrics(output) if "loss" in row]


@dataclass
class Run:
    output: Path
    summary: dict | None  # None: refused
    refusal: UserError | None = None

    @property
    def final(self) -> Path:
        return self.output / "final"

    def check(self) -> None:
        """Raise the refusal again in the cell that depends on it."""
        if self.refusal is not None:
            raise self.refusal


def attempt(config: TrainConfig) -> Run:
    try:
        return Run(Path(config.output_dir), train(config))
    except UserError as error:
        return Run(Path(config.output_dir), None, error)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def lora_run(family, family_folders, datasets, tmp_path_factory) -> Run:
    """3 LoRA steps with the default targets, a checkpoint at step 2, merged at the end."""
    output = tmp_path_factory.mktemp(f"{family}-lora")
    return attempt(run_config(family_folders[family], datasets["chat"], output, lora=True, lora_r=4, lora_alpha=8,
                              lora_dropout=0.0, max_steps=LORA_STEPS, save_every=2, merge_lora=True))


@pytest.fixture(scope="module")
def full_runs(family, family_folders, datasets, tmp_path_factory) -> dict[str, Run]:
    """2 full steps, unpacked and packed (rows of twice the length, so that two conversations share one); 2 DPO
    steps."""
    runs = {}
    for name, packing in (("plain", False), ("packed", True)):
        output = tmp_path_factory.mktemp(f"{family}-full-{name}")
        runs[name] = attempt(run_config(family_folders[family], datasets["chat"], output, lr=FULL_LR, min_lr=FULL_LR,
                                        max_steps=FULL_STEPS, packing=packing, max_length=2 * MAX_LENGTH))
    output = tmp_path_factory.mktemp(f"{family}-dpo")
    runs["dpo"] = attempt(run_config(family_folders[family], datasets["pairs"], output, objective="dpo", lr=FULL_LR,
                                     min_lr=FULL_LR, max_steps=FULL_STEPS, max_grad_norm=None))
    return runs


def load(folder: Path):
    from gpt4all_training.model.loading import load_model

    return load_model(str(folder)).eval()


@torch.no_grad()
def logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0]


def chat_ids(tokenizer, messages: list[dict], generation_prompt: bool = False) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                         return_dict=False)


# ---------------------------------------------------------------- LoRA's targets (fast)

def layer_kinds(target_modules) -> list[str]:
    """PEFT's all-linear names every layer's module by its path: the distinct last parts."""
    return sorted({name.rsplit(".", 1)[-1] for name in target_modules})


def test_explicit_lora_targets_still_choose(chat_tokenizer):
    """Phi-3's fused qkv_proj/gate_up_proj had no default in PEFT (`lora_target_modules: Please specify
    target_modules`): every linear layer but the head is the default now (test_sft_lora checks it for every
    family's run), and targets that are named are the only ones adapted."""
    from gpt4all_training.model.lora import apply_lora

    model = apply_lora(build_family_model("phi3", chat_tokenizer), 4, 8, 0.0, None, False)
    assert layer_kinds(model.peft_config["default"].target_modules) == LINEAR_LAYERS["phi3"]
    assert type(model.get_output_embeddings()) is torch.nn.Linear  # not wrapped by LoRA
    model = apply_lora(build_family_model("phi3", chat_tokenizer), 4, 8, 0.0, ["qkv_proj"], False)
    adapted = {n.split(".lora_A.")[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert adapted == {"qkv_proj"}


# ---------------------------------------------------------------- what the matrix found (fast)

def test_a_tokenizer_saved_with_a_qwen2_model_splits_text_as_it_did_when_saved(chat_tokenizer, tmp_path):
    """transformers 5 loads the tokenizer of a qwen2 folder as Qwen2Tokenizer, which rebuilds Qwen's pre-tokenizer
    whatever tokenizer.json says: a tokenizer of another design saved with such a model (one trained by `tokenizer`
    for an `init: from_config` run, this matrix's) gave other ids once read back."""
    build_family_model("qwen2.5", chat_tokenizer).save_pretrained(tmp_path)
    chat_tokenizer.save_pretrained(tmp_path)
    text = "Name 3 fish, 12 cats and 45.5 spaces  here."
    assert load_tokenizer(tmp_path)(text)["input_ids"] == chat_tokenizer(text)["input_ids"]


# ---------------------------------------------------------------- training

@pytest.mark.integration
@pytest.mark.slow
def test_sft_lora(family, lora_run, family_folders, datasets, chat_tokenizer):
    """The first step's loss is the base model's NLL of every trained token (the adapter starts at zero), computed
    here from transformers' full logits one conversation at a time; the adapter holds every linear layer but the
    output head (PEFT's all-linear, the default); 3 steps lower the loss."""
    from gpt4all_training.data.sft import load_data

    def check():
        lora_run.check()
        (train_ds, _), _ = load_data(run_config(family_folders[family], datasets["chat"], "unused"), chat_tokenizer)
        base = load(family_folders[family])
        total, count = 0.0, 0
        for row in train_ds:
            labels = torch.tensor(row["labels"][1:])
            trained = labels != -100
            log_probs = logits(base, row["input_ids"])[:-1].float().log_softmax(-1)
            total -= float(log_probs[trained].gather(1, labels[trained][:, None]).sum())
            count += int(trained.sum())
        steps = losses(lora_run.output)
        assert steps[0] == pytest.approx(total / count, rel=ROUNDING)
        assert steps[-1] < steps[0], steps
        adapter = json.loads((lora_run.final / "adapter_config.json").read_text())
        assert layer_kinds(adapter["target_modules"]) == LINEAR_LAYERS[family]

    observe(SOURCE, family, "sft_lora", check)


@pytest.mark.integration
@pytest.mark.slow
def test_exact_resume(family, lora_run, family_folders, datasets, tmp_path):
    """Resumed from step 2, the run ends bitwise where the uninterrupted one did."""

    def check():
        lora_run.check()
        config = run_config(family_folders[family], datasets["chat"], tmp_path / "resumed", lora=True, lora_r=4,
                            lora_alpha=8, lora_dropout=0.0, max_steps=LORA_STEPS, save_every=2,
                            checkpoint=str(lora_run.output / "step_2"))
        train(config)
        assert_bitwise_equal_weights(tmp_path / "resumed" / "final", lora_run.final)
        assert exact_rows(tmp_path / "resumed")[-1] == exact_rows(lora_run.output)[-1]

    observe(SOURCE, family, "resume", check)


@pytest.mark.integration
@pytest.mark.slow
def test_sft_full(family, full_runs):
    def check():
        full_runs["plain"].check()
        steps = losses(full_runs["plain"].output)
        assert len(steps) == FULL_STEPS and steps[-1] < steps[0], steps

    observe(SOURCE, family, "sft_full", check)


@pytest.mark.integration
@pytest.mark.slow
def test_packing(family, full_runs):
    """Packed rows (two conversations in one, each attending to itself alone) train the same steps: losses within
    float rounding of the padded run's, weights within what Adam makes of that rounding."""

    def check():
        plain, packed = full_runs["plain"], full_runs["packed"]
        packed.check()
        plain.check()
        assert packed.summary["padding_fraction"] < plain.summary["padding_fraction"]
        assert losses(packed.output) == pytest.approx(losses(plain.output), rel=ROUNDING)
        assert max_weight_difference(packed.final, plain.final) < PACKED_WEIGHTS * FULL_LR

    observe(SOURCE, family, "packing", check)


@pytest.mark.integration
@pytest.mark.slow
def test_dpo(family, full_runs):
    """The policy starts as its reference, so the first loss is ln 2; a step on the pairs lowers it."""

    def check():
        full_runs["dpo"].check()
        steps = losses(full_runs["dpo"].output)
        assert steps[0] == pytest.approx(math.log(2), abs=1e-6)
        assert steps[1] < steps[0]

    observe(SOURCE, family, "dpo", check)


@pytest.mark.integration
@pytest.mark.slow
def test_merge(family, lora_run):
    """final/merged gives the logits of the base with the adapter (PEFT's own forward)."""

    def check():
        lora_run.check()
        ids = chat_ids(load_tokenizer(lora_run.final), CONVERSATIONS[1])
        over_base, merged = logits(load(lora_run.final), ids), logits(load(lora_run.final / "merged"), ids)
        assert (over_base - merged).abs().max() <= ROUNDING * merged.abs().max()

    observe(SOURCE, family, "merge", check)


def load_tokenizer(folder: Path):
    from gpt4all_training.model.loading import load_tokenizer as load

    return load(str(folder))


# ---------------------------------------------------------------- using the trained model

def transformers_replies(folder: Path) -> list[str]:
    """transformers' own greedy generate, one conversation at a time (no padding), up to the end of the turn."""
    model, tokenizer = load(folder), load_tokenizer(folder)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    replies = []
    for messages in CONVERSATIONS:
        ids = chat_ids(tokenizer, messages, generation_prompt=True)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=[end_of_turn, tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
        new = [t for t in out[0, len(ids):].tolist() if t not in (end_of_turn, tokenizer.eos_token_id)]
        replies.append(tokenizer.decode(new, skip_special_tokens=True))
    return replies


@pytest.fixture(scope="module")
def expected_replies(lora_run) -> list[str] | None:
    return transformers_replies(lora_run.final / "merged") if lora_run.summary else None


@pytest.mark.integration
@pytest.mark.slow
def test_generate(family, lora_run, expected_replies):
    """`generate` over the adapter, both conversations in one left-padded batch, replies what transformers'
    generate does with the merged model alone on each."""
    from gpt4all_training.config.schemas import GenerateConfig
    from gpt4all_training.generation.generate import load_generator

    def check():
        lora_run.check()
        generator = load_generator(validate(GenerateConfig(model_name=str(lora_run.final), temperature=0.0,
                                                           max_new_tokens=NEW_TOKENS, batch_size=2)))
        assert all(expected_replies)  # text to compare, not two empty turns
        assert generator.reply(CONVERSATIONS) == expected_replies

    observe(SOURCE, family, "generate", check)


@pytest.mark.integration
@pytest.mark.slow
def test_serve(family, lora_run, expected_replies):
    """The server (its app and engine, in process) answers both conversations, sent at once through the openai
    client, as transformers' generate does."""
    from openai import OpenAI
    from starlette.testclient import TestClient

    from gpt4all_training.model.trained import open_model
    from gpt4all_training.serving.app import ServeSettings, context_length, create_app, eos_ids
    from gpt4all_training.serving.engine import Engine

    def check():
        lora_run.check()
        model, tokenizer = open_model(str(lora_run.final), torch.float32, torch.device("cpu"))
        settings = ServeSettings(model_id="run")
        engine = Engine(model, tokenizer, eos_ids(model, tokenizer), 2, settings.max_queue)
        app = create_app(engine, tokenizer, settings, context_length(model, tokenizer))
        with TestClient(app, base_url="http://127.0.0.1:8000") as http:  # a name of this machine: the guard's Host
            client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused", http_client=http)

            def ask(messages):
                answer = client.chat.completions.create(model="run", messages=messages, max_tokens=NEW_TOKENS,
                                                        temperature=0)
                return answer.choices[0].message.content

            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                replies = list(pool.map(ask, CONVERSATIONS))
        assert replies == expected_replies

    observe(SOURCE, family, "serve", check)


@pytest.fixture(scope="module")
def eval_tasks():
    """The harness's task manager and task, read once for every family."""
    from gpt4all_training.evaluation.harness import EvalSettings, load_tasks, task_manager_for

    settings = EvalSettings(tasks=(EVAL_TASK,), include_paths=(str(REPO / "configs" / "eval"),), limit=4)
    manager = task_manager_for(settings.tasks, settings.include_paths)
    return settings, manager, load_tasks(manager, settings.tasks)


@pytest.mark.integration
@pytest.mark.slow
def test_eval(family, lora_run, eval_tasks):
    """The harness scores the adapter over its base (opened as `eval` opens it) as it scores the merged model."""
    from gpt4all_training.evaluation.harness import score
    from gpt4all_training.evaluation.results import scores
    from gpt4all_training.model.trained import open_model

    def check():
        lora_run.check()
        settings, manager, tasks = eval_tasks
        results = {}
        for name in (lora_run.final, lora_run.final / "merged"):
            model, tokenizer = open_model(str(name), torch.float32, torch.device("cpu"))
            results[name] = scores(score(model, tokenizer, manager, tasks, settings, str(name)))
        over_base, merged = results.values()
        assert over_base.keys() == merged.keys() == {EVAL_TASK}
        assert over_base[EVAL_TASK] == pytest.approx(merged[EVAL_TASK], rel=1e-5)

    observe(SOURCE, family, "eval", check)


@pytest.mark.integration
@pytest.mark.slow
def test_inference_embeddings(family, lora_run, datasets, tmp_path):
    """Each example's loss and last-token embedding, scored in right-padded batches, are those of the example run
    alone (within float rounding)."""
    import pyarrow.parquet as pq

    from gpt4all_training.analysis.inference import run_inference
    from gpt4all_training.data.sft import load_data

    def check():
        lora_run.check()
        merged = lora_run.final / "merged"
        config = validate(InferenceConfig(model_name=str(merged), dataset_path=str(datasets["chat"]),
                                          max_length=MAX_LENGTH, val_fraction=0.0, seed=0, batch_size=4,
                                          num_proc=1, output_dir=str(tmp_path / "inference")))
        table = pq.read_table(run_inference(config)).to_pylist()
        tokenizer = load_tokenizer(merged)
        (train_ds, _), _ = load_data(run_config(merged, datasets["chat"], "unused"), tokenizer)
        model = load(merged)
        assert len(table) == len(train_ds) == len(TOPICS)
        for row, example in zip(table, train_ds.sort("index")):
            with torch.no_grad():
                out = model(torch.tensor([example["input_ids"]]), output_hidden_states=True)
            labels = torch.tensor(example["labels"][1:])
            trained = labels != -100
            nll = -out.logits[0, :-1].float().log_softmax(-1)[trained].gather(1, labels[trained][:, None]).mean()
            assert row["loss"] == pytest.approx(float(nll), rel=ROUNDING)
            embedding = out.hidden_states[-1][0, -1].numpy()
            assert np.abs(np.asarray(row["embedding"]) - embedding).max() <= ROUNDING * np.abs(embedding).max()

    observe(SOURCE, family, "inference", check)


# ---------------------------------------------------------------- export

@pytest.mark.integration
@pytest.mark.slow
def test_export_hf(family, lora_run, tmp_path):
    """The adapter exported as an fp32 folder (merged on the way, as training merged it) gives final/merged's logits
    bit for bit and carries the chat template."""
    from gpt4all_training.export.hf import export

    def check():
        lora_run.check()
        export(str(lora_run.final), str(tmp_path / "hf"), "hf", "f32")
        exported, tokenizer = load(tmp_path / "hf"), load_tokenizer(tmp_path / "hf")
        assert tokenizer.chat_template == load_tokenizer(lora_run.final).chat_template
        ids = chat_ids(tokenizer, CONVERSATIONS[1])
        assert torch.equal(logits(exported, ids), logits(load(lora_run.final / "merged"), ids))

    observe(SOURCE, family, "export_hf", check)


@pytest.mark.parametrize("name", GGUF_HERE)
def test_export_gguf_refusal(name, family_folders, tmp_path):
    """A family no GGUF reader runs is refused in one line, from its config, before the weights load (the others'
    GGUF cells are tests/test_gguf.py's)."""
    from gpt4all_training.export.hf import export

    observe(SOURCE, name, "export_gguf", lambda: export(str(family_folders[name]), str(tmp_path / "gguf"), "gguf"))
