"""The blocks of fields the configs are made of, each with the checks that concern needs.

A block is a dataclass of the fields of one concern (where the model comes from, LoRA, the learning-rate schedule,
...). A config (`config/schemas.py`) inherits the blocks it needs, so its fields stay flat: the YAML keys, `asdict`
and the constructor see one plain dataclass, and an editor or type checker sees every field of every block.
Inheritance is used only to collect fields and checks; no block calls another.

`validate` runs, in order: the required keys, every field's type (`fields.typed`: the choices, finite floats, one
value where one is taken), then each block's `checks` (the block's own ranges), ending with the config's own checks
(how its blocks combine). The first failure is one `UserError` line, `{key}: {message}, got {value}`.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Annotated, Literal, Optional, TypeVar

from gpt4all_training.config.fields import Check, LocalPath, PathName, doc, quoted_choices, shown, typed
from gpt4all_training.config.objectives import OBJECTIVES, LossType, ObjectiveName, loss_types_allowed, objective_doc
from gpt4all_training.config.rewards import builtin_rewards_doc, reward_problem
from gpt4all_training.errors import UserError

Dtype = Literal["float32", "bfloat16", "float16"]
PromptTemplate = Literal["auto", "plain", "chat"]
MAX_SEED = 2**32 - 1
TrackerName = Literal["wandb", "tensorboard", "jsonl"]
# The tokenizer's end-of-text token: the first special token by default.
EOS = "<|endoftext|>"
# Held-out records for the tokenizer statistics are every HELDOUT_STRIDE-th record, so they spread over the stream.
HELDOUT_STRIDE = 10


@dataclass
class Block:
    """Base of the blocks and the configs: the field groups for `--help`, and `validate`. A dataclass without
    fields, so that a type checker knows every block is one."""

    def checks(self) -> list[Check]:
        """This block's own checks (a subclass defines its own; it is never inherited, see `declared_checks`)."""
        return []

    @classmethod
    def groups(cls) -> list[tuple[str, list[dataclasses.Field]]]:
        """(title, fields) per block in field order; the title is the first line of the block's docstring."""
        fields = dataclasses.fields(cls)
        # A field a config declares again (its own default) belongs to the config, not to the block it replaces.
        owner = {f.name: block for block in field_order_blocks(cls) for f in fields
                 if f.name in vars(block).get("__annotations__", {})}
        out = []
        for block in field_order_blocks(cls):
            own = [f for f in fields if owner.get(f.name) is block]
            if own:
                out.append(((block.__doc__ or block.__name__).strip().splitlines()[0], own))
        return out

    def required_keys(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self) if f.metadata.get("required"))

    def to_dict(self) -> dict[str, typing.Any]:
        return dataclasses.asdict(self)


AnyBlock = TypeVar("AnyBlock", bound=Block)


def field_order_blocks(cls: type) -> list[type]:
    """The blocks of `cls` (itself last), in the order a dataclass lays out their fields: its bases' MRO reversed."""
    return [c for c in reversed(cls.__mro__) if issubclass(c, Block) and c is not Block]


def declared_checks(config: Block) -> list[Check]:
    """Every block's checks, each block's own only: an inherited `checks` would otherwise run twice."""
    out = []
    for block in field_order_blocks(type(config)):
        own = vars(block).get("checks")
        if own is not None:
            out.extend(own(config))
    return out


def validate(config: AnyBlock) -> AnyBlock:
    """Required keys, every field's type and the ranges, as one UserError line naming the key. Returns the config,
    its values typed (a config built in Python is checked as a loaded one is)."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        setattr(config, f.name, typed(f.name, getattr(config, f.name), hints[f.name], f.metadata))
    for key in config.required_keys():
        if not getattr(config, key):
            raise UserError(f"{key}: missing; set it in the config or on the command line as {key}=...")
    for check in declared_checks(config):
        if not check.ok:
            got = f", got {shown(getattr(config, check.key))}" if check.got else ""
            raise UserError(f"{check.key}: {check.message}{got}")
    return config


def at_least_one(key: str, value: Optional[int], unset: str = "") -> Check:
    """`value` is unset or >= 1; `unset` words what leaving it unset means, for the message."""
    return Check(key, value is None or value >= 1, f"must be at least 1{unset}")


# ---------------------------------------------------------------- shared by several configs

@dataclass
class ModelSource(Block):
    """model: where the weights and the tokenizer come from."""
    model_name: Optional[PathName] = doc("Hub id, local folder or .gguf file of the model: the base to train, or "
                                         "a trained final/, final/merged/ or step_N/model (full model or LoRA "
                                         "adapter). Required.", required=True)
    tokenizer_name: Optional[PathName] = doc("Tokenizer to load; defaults to model_name.")
    gguf_file: Optional[Annotated[str, LocalPath(within="model_name")]] = doc(
        "GGUF file name inside the model_name folder, when the weights are GGUF.")
    chat_template: Optional[PathName] = doc("Chat template to render conversations and chat prompts with, replacing "
                                            "the tokenizer's own: a Jinja file, or 'chatml'. Unset: the tokenizer's. "
                                            "It is saved with the trained tokenizer, so exports carry it.")
    model_revision: Optional[str] = doc("Hub revision (branch, tag or commit) of the model.")
    trust_remote_code: bool = doc("Run model code shipped with a Hub repo. Off unless you say so.", False)
    dtype: Dtype = doc("Precision: float32, bfloat16 or float16. Inference and generation load the weights in it.",
                       "float32")


@dataclass
class DataSource(Block):
    """data source: which records are read."""
    dataset_path: Optional[PathName] = doc("A JSONL file (*_clean.jsonl for fine-tuning), a folder of them, or a "
                                           "Hub dataset id. Required.", required=True)
    revision: Optional[str] = doc("Hub revision (branch, tag or commit) of the dataset; pin it for reproducible "
                                  "data.")


@dataclass
class TextField(Block):
    """raw text: which field of a record holds it."""
    text_field: Optional[str] = doc("Raw text (causal_lm, tokenizer): the record field holding the text; unset: "
                                    "'text', else 'content'.")


@dataclass
class Examples(Block):
    """examples: how records become examples and the train/validation split (inference: the training values)."""
    streaming: bool = doc("causal_lm: read and tokenize records as training consumes them (needs max_steps). "
                          "sft (gpt4all compatibility): tokenize in this process (num_proc=1).", False)
    num_proc: int = doc("Processes for tokenization; capped at the machine's cores.", 4)
    max_length: int = doc("Longest tokenized example; longer ones are truncated (prompt end kept; a conversation "
                          "loses whole rounds from its start).", 1024)
    val_fraction: float = doc("Share of the data held out for validation.", 0.05)
    seed: int = doc("Seed of the train/validation split; training also seeds the data order and initialization "
                    "with it.", 42)
    train_turns: Literal["all", "last"] = doc("Conversations (records with messages): train every assistant turn "
                                              "('all') or only the last one ('last'). A message with \"train\": "
                                              "false is never trained.", "all", allowed="'all' or 'last'")
    train_reasoning: bool = doc("Conversations with reasoning (an assistant turn's reasoning_content, or the <think> "
                                "block its content opens with): train it as the chat template writes it (true), or "
                                "keep it as context and train the answer only (false).", True)

    def checks(self) -> list[Check]:
        return [
            Check("max_length", self.max_length >= 2, "must be at least 2"),
            Check("val_fraction", 0 <= self.val_fraction < 1, "must be in [0, 1)"),
            Check("num_proc", self.num_proc >= 1, "must be at least 1"),
            # NumPy's seeding takes no negative seed, and epoch_seed(seed, epoch) must fit a torch seed (64 bits).
            Check("seed", 0 <= self.seed <= MAX_SEED, f"must be between 0 and {MAX_SEED} (2^32 - 1)"),
        ]


@dataclass
class PromptFormat(Block):
    """prompt: how a prompt is written before the model sees it (inference, generation: the training value)."""
    prompt_template: PromptTemplate = doc("'plain' (prompt + newline), 'chat' (the tokenizer's chat template) or "
                                          "'auto'.", "auto", allowed="auto, plain or chat")


# ---------------------------------------------------------------- training

@dataclass
class TrainingCompute(Block):
    """compute: memory and speed of the training model."""
    gradient_checkpointing: bool = doc("Recompute activations in the backward pass to save memory.", False)
    compile: bool = doc("torch.compile the model: slower first steps (compilation), faster later ones.", False)


@dataclass
class LoRA(Block):
    """LoRA: train an adapter instead of every weight."""
    lora: bool = doc("Train a LoRA adapter instead of all weights.", False)
    lora_r: int = doc("LoRA rank.", 8)
    lora_alpha: int = doc("LoRA scaling numerator (scale = alpha / r).", 16)
    lora_dropout: float = doc("Dropout on the LoRA input.", 0.05)
    lora_target_modules: Optional[list[str]] = doc("Module names to adapt, e.g. [q_proj, v_proj]; unset: every "
                                                   "linear layer but the output head (PEFT's all-linear).")
    merge_lora: bool = doc("Also save the adapter merged into the base (merged in fp32) under final/merged.", False)
    merge_dtype: Dtype = doc("merge_lora: the precision final/merged is written in. The adapter is merged in fp32 "
                             "(into the dequantized base under quantization), then cast.", "float32")

    def checks(self) -> list[Check]:
        return [
            Check("lora_r", self.lora_r >= 1, "must be at least 1"),
            Check("lora_dropout", 0 <= self.lora_dropout < 1, "must be in [0, 1)"),
            Check("merge_dtype", self.merge_lora or self.merge_dtype == "float32",
                  "only merge_lora reads it; remove it or set merge_lora: true"),
        ]


@dataclass
class Quantization(Block):
    """quantization: the frozen base stored in 4 or 8 bits under a LoRA adapter (QLoRA), by bitsandbytes."""
    load_in_4bit: bool = doc("Store the base's linear layers in 4 bits (QLoRA: about 0.5 byte per weight plus its "
                             "quantization constants); the adapter trains in fp32 over them, computing in dtype. "
                             "Needs lora: true.", False)
    load_in_8bit: bool = doc("Store the base's linear layers in 8 bits (LLM.int8, about 1 byte per weight). Needs "
                             "lora: true; not under FSDP2 or ZeRO-3, which do not shard int8 weights.", False)
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = doc("load_in_4bit: 'nf4' (NormalFloat, QLoRA's) or 'fp4'.", "nf4")
    bnb_4bit_use_double_quant: bool = doc("load_in_4bit: quantize the quantization constants too (about 0.37 bit "
                                          "per weight saved, as QLoRA).", True)

    def checks(self) -> list[Check]:
        defaults = Quantization()
        unread = "only load_in_4bit reads it; remove it or set load_in_4bit: true"
        return [
            Check("load_in_8bit", not (self.load_in_4bit and self.load_in_8bit),
                  "load_in_4bit and load_in_8bit exclude each other; set one", got=False),
            Check("bnb_4bit_quant_type", self.load_in_4bit or self.bnb_4bit_quant_type == defaults.bnb_4bit_quant_type,
                  unread),
            Check("bnb_4bit_use_double_quant",
                  self.load_in_4bit or self.bnb_4bit_use_double_quant == defaults.bnb_4bit_use_double_quant, unread),
        ]


@dataclass
class Objective(Block):
    """objective: what the loss trains, and where the starting weights come from."""
    objective: ObjectiveName = doc(objective_doc(), "sft", allowed=quoted_choices(tuple(OBJECTIVES)))
    init: Literal["pretrained", "from_config"] = doc(
        "'pretrained': load model_name's weights. 'from_config' (causal_lm only): random weights from "
        "model_config, vocabulary sized to the tokenizer.", "pretrained", allowed="'pretrained' or 'from_config'")
    model_config: Optional[PathName] = doc("init from_config: a local folder, a model type (gptj, llama, ...) or a "
                                           "Hub id whose config is used; unset: model_name's.")
    model_config_overrides: Optional[dict] = doc("init from_config: fields set on model_config, e.g. "
                                                 "{n_layer: 4, n_embd: 256}.")
    shuffle_buffer: int = doc("causal_lm: rows are shuffled through a buffer of this many, seeded per epoch.", 1000)
    z_loss: float = doc("causal_lm: add z_loss x log(Z)^2 per token (mesh-transformer-jax used 1e-4); 0: off.", 0.0)

    def checks(self) -> list[Check]:
        return [
            Check("init", self.init == "pretrained" or self.objective == "causal_lm",
                  "from_config needs objective: causal_lm"),
            Check("shuffle_buffer", self.shuffle_buffer >= 1, "must be at least 1 (1 keeps the stream's order)"),
            Check("z_loss", self.z_loss >= 0 and math.isfinite(self.z_loss), "must be >= 0"),
        ]


@dataclass
class Preference(Block):
    """preference tuning (objective dpo; beta and loss_type also grpo's): the loss, and the reference it is measured
    from."""
    beta: Optional[float] = doc(
        "How far the trained model may move from the reference (TRL's beta). dpo: the reward is beta x the "
        "log-probability ratio; sigmoid and ipo: 0.1 to 0.5 is usual, simpo's paper uses 2.0 to 2.5; unset: 0.1. "
        "grpo: the weight of the KL term to the reference; unset: 0, which runs no reference at all "
        "(DeepSeek-R1 used 0.001).")
    loss_type: Optional[LossType] = doc(
        "dpo: 'sigmoid' (DPO, Rafailov et al. 2023; the default), 'ipo' (IPO, the squared loss on per-token "
        "log-ratios, Azar et al. 2023, as TRL) or 'simpo' (SimPO, reference-free, on per-token log-probabilities "
        "with a target margin simpo_gamma, Meng et al. 2024). grpo, how the per-token losses are averaged (as TRL): "
        "'dapo' (the default: over every completion token of the optimizer step), 'grpo' (over each completion's "
        "tokens, then over completions: short answers weigh more per token) or 'dr_grpo' (the sum over "
        "max_completion_length x completions, Dr. GRPO).",
        allowed=loss_types_allowed())
    label_smoothing: float = doc("sigmoid, simpo: the share of pairs assumed to be labelled the wrong way round "
                                 "(conservative DPO); 0: off.", 0.0)
    simpo_gamma: float = doc("simpo: the target reward margin between the chosen and the rejected answer.", 0.5)
    sft_weight: float = doc(
        "dpo: the weight of a language-modelling term added to each pair's loss, the chosen answer's mean "
        "negative log-likelihood per token: RPO (Pang et al. 2024, weight 1.0), which keeps DPO from lowering the "
        "chosen answer's likelihood along with the rejected one's when the two share most of their tokens. TRL: "
        "loss_type [sigmoid, sft] with loss_weights [1, sft_weight] (its sft term averages over a micro-batch's "
        "tokens, this one over each pair's, so every pair weighs the same whatever the batch); 0: off.", 0.0)
    reference: Optional[Literal["precomputed", "frozen_copy"]] = doc(
        "Full fine-tuning with sigmoid or ipo: where the reference log-probabilities come from. Unset or "
        "'precomputed': one pass of the initial weights over the pairs before step 1, cached with the tokenized "
        "data; training holds no reference model. 'frozen_copy': a frozen copy of the initial weights scores every "
        "micro-batch (one more fp32 copy of the model per process; not under ZeRO-3 or FSDP2). With LoRA the "
        "reference is the base model with the adapter disabled, and simpo has none: leave it unset. grpo with "
        "beta > 0 and full fine-tuning always uses a frozen copy (its completions are new at every step).",
        allowed="'precomputed', 'frozen_copy' or unset")

    def checks(self) -> list[Check]:
        return [Check("label_smoothing", 0 <= self.label_smoothing < 0.5, "must be in [0, 0.5)"),
                Check("sft_weight", self.sft_weight >= 0, "must be >= 0 (0: off)")]


@dataclass
class Rollouts(Block):
    """reinforcement learning (objective grpo): completions sampled from the model being trained, and their rewards."""
    rewards: Optional[Annotated[list[dict], LocalPath(keys=("module",), runs_code=True)]] = doc(
        f"What scores a completion; the weighted sum of these is its reward. Built in: {builtin_rewards_doc()}. "
        "Your own: {module: path/to/file.py, function: name}, called as TRL calls one (prompts, completions, "
        "completion_ids and every record field as keyword lists), returning one float per completion. Each takes a "
        "weight (default 1). Required for grpo.")
    num_generations: int = doc("Completions sampled per prompt: the group whose rewards are compared (TRL's "
                               "num_generations). batch_size counts prompts, so a micro-batch holds batch_size x "
                               "num_generations completions.", 8)
    max_completion_length: int = doc("Most tokens of a completion (its EOS included); EOS or the chat template's "
                                     "end of turn ends it sooner. max_length bounds the prompt.", 256)
    temperature: float = doc("Temperature of the sampling, and of the log-probabilities the loss compares (as "
                             "TRL's).", 1.0)
    top_p: float = doc("Nucleus sampling of the completions: keep the most likely tokens whose probabilities sum to "
                       "top_p; 1 keeps all.", 1.0)
    epsilon: float = doc("The probability ratio is clipped to [1 - epsilon, 1 + epsilon_high] (PPO's clip).", 0.2)
    epsilon_high: Optional[float] = doc("The upper clip; unset: epsilon. DAPO's asymmetric clip uses 0.28.")
    scale_rewards: Literal["group", "batch", "none"] = doc(
        "Advantages are rewards minus their group's mean, divided by the standard deviation (Bessel's, + 1e-4) "
        "of the group ('group'), of the whole step's rewards on every process ('batch') or not at all ('none', "
        "as Dr. GRPO recommends).", "group", allowed="'group', 'batch' or 'none'")
    num_iterations: int = doc("Updates per batch of completions (GRPO's mu): the log-probabilities at sampling time "
                              "stay the ratio's denominator while the weights move. Every optimizer step is one "
                              "update, so the run samples once every num_iterations steps.", 1)
    mask_truncated_completions: bool = doc("Completions cut at max_completion_length (no EOS) take no part in the "
                                           "loss (DAPO's overlong filtering).", False)

    def checks(self) -> list[Check]:
        rewards = reward_problem(self.rewards, self.max_completion_length) if self.rewards is not None else None
        return [
            Check("num_generations", self.num_generations >= 2,
                  "must be at least 2: a group of one completion has nothing to be compared with"),
            Check("max_completion_length", self.max_completion_length >= 1, "must be at least 1"),
            Check("temperature", self.temperature > 0,
                  "must be > 0: greedy completions of one prompt are all the same, and their advantages 0"),
            Check("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            Check("epsilon", 0 < self.epsilon < 1, "must be in (0, 1)"),
            Check("epsilon_high", self.epsilon_high is None or self.epsilon_high > 0, "must be > 0 (or unset)"),
            Check("num_iterations", self.num_iterations >= 1, "must be at least 1"),
            Check("rewards", rewards is None, str(rewards), got=False),
        ]


@dataclass
class Batching(Block):
    """batches: how examples make micro-batches and optimizer steps."""
    batch_size: int = doc("Micro-batch size per process (dpo: pairs, each two sequences).", 8)
    gradient_accumulation_steps: int = doc("Micro-batches per optimizer step.", 1)
    packing: bool = doc("Pack each micro-batch's examples into rows of up to max_length (none split; attention and "
                        "positions restart per example). The steps train on the same examples as without.", False)
    group_by_length: bool = doc("Batch examples of similar length together (sorted within random groups of 16 "
                                "steps), so batches pad less; epochs still shuffle.", False)

    def checks(self) -> list[Check]:
        return [
            Check("batch_size", self.batch_size >= 1, "must be at least 1"),
            Check("gradient_accumulation_steps", self.gradient_accumulation_steps >= 1, "must be at least 1"),
        ]


@dataclass
class Schedule(Block):
    """schedule: the learning rate at each optimizer step, and how many steps there are."""
    lr: float = doc("Peak learning rate.", 2.0e-5)
    min_lr: float = doc("Learning rate at the last step (cosine ends here).", 0.0)
    warmup_steps: int = doc("Linear warmup length in optimizer steps.", 100)
    lr_schedule: Literal["cosine", "gpt3"] = doc(
        "'cosine': warmup, then cosine to min_lr at the last step. 'gpt3' (mesh-transformer-jax): warmup, then a "
        "half-cosine to end_lr over anneal_steps, then end_lr.", "cosine", allowed="'cosine' or 'gpt3'")
    anneal_steps: Optional[int] = doc("gpt3 schedule: optimizer steps of the half-cosine after warmup (required "
                                      "for gpt3; `plan` suggests one).")
    end_lr: float = doc("gpt3 schedule: the learning rate after annealing, kept until the run ends.", 0.0)
    num_epochs: int = doc("Passes over the training data.", 1)
    max_steps: Optional[int] = doc("Stop after this many optimizer steps (for short runs).")

    def checks(self) -> list[Check]:
        needs_anneal = self.lr_schedule == "gpt3"
        return [
            Check("lr", self.lr > 0 and math.isfinite(self.lr), "must be > 0"),
            Check("min_lr", 0 <= self.min_lr <= self.lr, f"must be between 0 and lr ({self.lr})"),
            Check("num_epochs", self.num_epochs >= 1, "must be at least 1"),
            Check("warmup_steps", self.warmup_steps >= 0, "must be >= 0"),
            Check("anneal_steps", self.anneal_steps is not None and self.anneal_steps >= 1 if needs_anneal
                  else self.anneal_steps is None or self.anneal_steps >= 1,
                  "must be at least 1 (lr_schedule: gpt3 needs it)"),
            Check("end_lr", 0 <= self.end_lr <= self.lr, f"must be between 0 and lr ({self.lr})"),
            at_least_one("max_steps", self.max_steps),
        ]


@dataclass
class Optimizer(Block):
    """optimizer: which, its weight decay and gradient clipping."""
    optimizer: Literal["adamw", "adamw_fused", "adamw_8bit", "sgd"] = doc(
        "adamw (torch's multi-tensor AdamW), adamw_fused (its fused kernel: CPU, CUDA and a few more), adamw_8bit "
        "(bitsandbytes: moments stored in 8 bits, a quarter of the state memory) or sgd (no momentum).", "adamw")
    weight_decay: float = doc("Weight decay (decoupled for AdamW); biases, norms and embeddings are exempt.", 0.0)
    max_grad_norm: Optional[float] = doc("Clip the global gradient norm to this; unset disables clipping.", 1.0)

    def checks(self) -> list[Check]:
        return [
            Check("weight_decay", self.weight_decay >= 0, "must be >= 0"),
            Check("max_grad_norm", self.max_grad_norm is None or self.max_grad_norm > 0,
                  "must be > 0 (or unset to disable)"),
        ]


@dataclass
class Faults(Block):
    """faults: what a NaN loss or a silent peer does to the run."""
    nan_policy: Literal["stop", "skip"] = doc(
        "A step whose loss is NaN or infinite: 'stop' ends the run with an error naming the step; 'skip' drops "
        "that step's update (gradients zeroed, the step still counts) and counts it as skipped_steps in "
        "metrics.jsonl and the summary.", "stop", allowed="'stop' or 'skip'")
    ddp_timeout_s: Optional[int] = doc("Several processes: seconds a rank waits in a collective for the others "
                                       "before it stops with an error (a rank that died or hangs); unset: torch's "
                                       "default (NCCL 10 min, gloo 30 min).")

    def checks(self) -> list[Check]:
        return [at_least_one("ddp_timeout_s", self.ddp_timeout_s, " (or unset)")]


@dataclass
class Evaluation(Block):
    """evaluation: when validation runs and how much of it."""
    eval_every: Optional[int] = doc("Validate every N optimizer steps (and at the end); unset: only at the end.", 500)
    eval_steps: Optional[int] = doc("At most this many validation batches; unset: all.")
    eval_tasks: Optional[list[str]] = doc("lm-evaluation-harness tasks to score final/ on once training ends, as "
                                          "`gpt4all-training eval --tasks` does: written to output_dir/eval/"
                                          "results.json and logged as harness/<task>/<metric>; unset: none.")
    eval_tasks_limit: Optional[int] = doc("eval_tasks: score the first N examples of each task; unset: all.")
    eval_include_path: Optional[PathName] = doc("eval_tasks: a folder of task YAML files (e.g. configs/eval).")
    eval_tasks_every: Optional[int] = doc("eval_tasks: also score the model being trained every N optimizer steps "
                                          "(with eval_tasks_limit), logged as harness/<task>/<metric> at that step; "
                                          "needs every process to hold the whole model (not ZeRO-3 or FSDP2); "
                                          "unset: final/ only.")

    def checks(self) -> list[Check]:
        return [at_least_one("eval_steps", self.eval_steps),
                at_least_one("eval_every", self.eval_every, " (or unset to disable)"),
                at_least_one("eval_tasks_limit", self.eval_tasks_limit, " (or unset)"),
                at_least_one("eval_tasks_every", self.eval_tasks_every, " (or unset)"),
                Check("eval_tasks_every", self.eval_tasks_every is None or bool(self.eval_tasks),
                      "needs eval_tasks, the tasks to score")]


@dataclass
class Checkpoints(Block):
    """checkpoints: where the run writes, what it keeps, and where it resumes from."""
    save_every: Optional[int] = doc("Checkpoint every N optimizer steps; unset: no intermediate checkpoints.", 500)
    keep_last: Optional[int] = doc("Keep the newest N checkpoints; unset keeps all.", 2)
    keep_every: Optional[int] = doc("Also keep, permanently, the checkpoints at multiples of N steps.")
    output_dir: PathName = doc("Where checkpoints, final/, metrics.jsonl and report.html go.", "ckpts/run")
    cache_dir: Optional[PathName] = doc("Where fine-tuning data is cached once tokenized, keyed by the records, "
                                        "the tokenizer, the data settings and the code; a shared folder lets other "
                                        "runs reuse it. Unset: output_dir/tokenized.")
    checkpoint: Optional[PathName] = doc("A step_N folder to resume from.")
    resume: Optional[Literal["auto", "never"]] = doc(
        "Unset: a rerun into an output_dir whose last run left a checkpoint continues that run (a config that "
        "changes what it trains, or a run that already finished, is refused). 'auto': resume from the newest "
        "complete checkpoint of the last run in output_dir, or start fresh when there is none. 'never': start over, "
        "after moving what earlier runs wrote in output_dir into output_dir/set-aside-K/ (nothing is deleted).",
        allowed="'auto' or unset; to resume from a folder use checkpoint=PATH, to start over use 'never'")
    resume_allow_changes: list[str] = doc(
        "Keys that may differ from the checkpoint's config when resuming, e.g. [max_steps]. Any other change that "
        "alters the trained result (lr, data, max_length, dtype, ...) is refused; logging, evaluation and "
        "checkpoint cadence and output paths may always change.", factory=list)

    def checks(self) -> list[Check]:
        keys = {f.name for f in dataclasses.fields(self)}
        return [at_least_one("keep_last", self.keep_last), at_least_one("keep_every", self.keep_every, " (or unset)"),
                at_least_one("save_every", self.save_every, " (or unset to disable)"),
                Check("output_dir", bool(self.output_dir.strip()),
                      "must name a folder (empty would write into the current folder)"),
                Check("resume_allow_changes", set(self.resume_allow_changes) <= keys,
                      "must list config keys only")]


@dataclass
class Logging(Block):
    """logging: which metrics are written where, and how often."""
    log_every: int = doc("Log training metrics every N optimizer steps.", 1)
    log_grads_every: Optional[int] = doc("With wandb: log gradient histograms every N steps.", 100)
    log_lr_every: Optional[int] = doc("gpt4all compatibility; the lr is logged with every training row.", 1)
    report_to: list[TrackerName] = doc("Any of wandb, tensorboard, jsonl.", factory=lambda: ["jsonl"])
    wandb: bool = doc("gpt4all compatibility: same as adding 'wandb' to report_to.", False)
    wandb_entity: Optional[str] = doc("wandb entity (team or user).")
    wandb_project_name: Optional[str] = doc("wandb project.", "gpt4all-training")

    def __post_init__(self) -> None:
        if self.wandb and "wandb" not in self.report_to:
            self.report_to = [*self.report_to, "wandb"]

    def checks(self) -> list[Check]:
        return [Check("log_every", self.log_every >= 1, "must be at least 1"),
                at_least_one("log_grads_every", self.log_grads_every, " (or unset to disable)"),
                at_least_one("log_lr_every", self.log_lr_every, " (or unset to disable)")]


@dataclass
class Publishing(Block):
    """publishing: pushing final/ to the Hub."""
    push_to_hub: bool = doc("Push final/ to the Hub as save_name when training succeeds.", False)
    save_name: Optional[str] = doc("Hub repo id for push_to_hub.")

    def checks(self) -> list[Check]:
        return [Check("push_to_hub", not self.push_to_hub or bool(self.save_name), "needs save_name (the Hub repo id)")]
