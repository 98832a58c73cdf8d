"""The four configs: training, inference, generation and tokenizer training, each made of blocks of fields.

Every key gpt4all's configs used is accepted by `TrainConfig` with the same meaning; every key has a default except
the required ones (`model_name`, `dataset_path`). The blocks (`config/blocks.py`) hold the fields and checks that
several configs share; a config adds its own fields and the checks of how its blocks combine.

A dataclass lays out the fields of its bases from the last base to the first, so each config lists its blocks
last-first: the YAML keys, `asdict` and `--help` then read in the order of the blocks' concerns, model first.
The first line of a config's docstring titles its own fields in `--help`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, Optional

from gpt4all_training.config.blocks import (EOS, HELDOUT_STRIDE, Batching, Checkpoints, DataSource, Evaluation,
                                            Examples, Faults, LoRA, Logging, ModelSource, Objective, Optimizer,
                                            Preference, PromptFormat, Publishing, Quantization, Rollouts, Schedule,
                                            TextField, TrainingCompute, at_least_one)
from gpt4all_training.config.fields import Check, LocalPath, PathName, doc
from gpt4all_training.config.objectives import OBJECTIVES, objective_checks
from gpt4all_training.config.rewards import checker_problem


@dataclass
class TrainConfig(Publishing, Logging, Checkpoints, Evaluation, Faults, Optimizer, Schedule, Batching, PromptFormat,
                  Examples, DataSource, TextField, Rollouts, Preference, Objective, Quantization, LoRA, TrainingCompute,
                  ModelSource):
    """training: a fine-tuning, preference-tuning, reinforcement-learning or pretraining run (`train`; `data`, `plan`
    and `check` read the same config)."""
    # Training alone also takes auto (resolved before the run starts, training/precision.py); the other configs load
    # weights in their dtype and take only the concrete ones, hence the wider type than ModelSource's.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = doc(  # type: ignore[assignment]
        "Compute precision: auto, float32, bfloat16 or float16. Training autocasts over fp32 master weights. auto is "
        "bfloat16 on a GPU with bf16 and on a CPU with native bf16 (AMX or AVX512-BF16), float32 elsewhere; a resumed "
        "run keeps the dtype its run resolved.", "auto")

    def __post_init__(self) -> None:
        super().__post_init__()
        spec = OBJECTIVES.get(self.objective)
        for key, value in (spec.defaults if spec is not None else {}).items():
            if getattr(self, key) is None:
                setattr(self, key, value)

    def required_keys(self) -> tuple[str, ...]:
        # init from_config builds the model from model_config: there is no base model to name.
        return tuple(k for k in super().required_keys() if k != "model_name" or self.init == "pretrained")

    def checks(self) -> list[Check]:
        scratch = self.init == "from_config"
        return [
            Check("init", not scratch or not self.lora, "from_config trains every weight; set lora: false"),
            Check(self.quantized_key or "load_in_4bit", not self.quantized_key or self.lora,
                  "a quantized base stays frozen and only a LoRA adapter trains over it (QLoRA): set lora: true, "
                  "or drop it to fine-tune every weight", got=False),
            Check("model_config", not scratch or bool(self.model_config or self.model_name),
                  "init from_config needs model_config (a folder, a model type such as gptj, or a Hub id)"),
            Check("tokenizer_name", not scratch or bool(self.tokenizer_name or self.model_name),
                  "init from_config needs tokenizer_name (e.g. a folder written by `gpt4all-training tokenizer`)"),
            *objective_checks(self),
            Check("reference", self.reference is None or not self.lora,
                  "with LoRA the reference is the base model with the adapter disabled; leave reference unset"),
        ]

    @property
    def quantized_key(self) -> str | None:
        """The key that quantizes the base (load_in_4bit or load_in_8bit), or None."""
        return "load_in_4bit" if self.load_in_4bit else "load_in_8bit" if self.load_in_8bit else None


@dataclass
class InferenceConfig(PromptFormat, Examples, DataSource, ModelSource):
    """inference: batching, pooling and where the results go.

    `gpt4all-training inference`. The data keys must equal the training config's, or the split and the tokens
    differ from what training saw.
    """
    batch_size: int = doc("Examples per forward pass, per process.", 8)
    pooling: Literal["last", "mean"] = doc("Embedding: 'last' (hidden state of the last real token) or 'mean' "
                                           "(over real tokens).", "last")
    output_dir: PathName = doc("Where inference.parquet and inference.json go.", "ckpts/inference")
    ifd: bool = doc("Also write response_loss (the loss of the trained tokens with the prompt left out) and ifd "
                    "(loss / response_loss: Instruction-Following Difficulty, Li et al. 2023); one more forward pass "
                    "per example.", False)
    base_model: Optional[PathName] = doc("The model model_name was fine-tuned from (a folder or Hub id sharing its "
                                         "tokenizer): also write base_loss (the same tokens' loss under it) and "
                                         "loss_change (loss - base_loss).")
    ifd_model: Optional[PathName] = doc("A small proxy model (any folder or Hub id, e.g. the base model; it tokenizes "
                                        "with its own tokenizer): also write proxy_ifd, the IFD under it "
                                        "(Superfiltering, Li et al. 2024).")
    checker: Optional[Annotated[dict, LocalPath(keys=("module",), runs_code=True)]] = doc(
        "Also decode every example's answer greedily (the prompt up to its last trained turn) and write it as "
        "model_answer, and agreement: the checker's score of it against the record's response. Built in: {name: "
        "exact_match} (1 when equal after strip; `pattern`: a regex whose last match, or its first group, is the "
        "answer compared; `field`: the record field to compare with, default response) or {name: numeric_match} "
        "(the last number within `tolerance`). Your own: {module: path/to/file.py, function: name}, called as a grpo "
        "reward is (prompts, completions, completion_ids and every record field as keyword lists), returning one "
        "number per record. One decode per example: leave unset to skip it.")
    checker_max_new_tokens: int = doc("checker: the most tokens decoded per answer.", 64)
    verifier: Optional[Annotated[dict, LocalPath(keys=("module",), runs_code=True)]] = doc(
        "Also write verified: a verifier's score of each record's own response, no model involved. Given as checker "
        "is and called as it is, with the record's response as the completion: a function that computes the right "
        "answer from the prompt (or runs the code, or reads a reference field) and scores the response against it. "
        "`curate --drop 'verified<1'` then drops the records whose answer is wrong.")
    outliers: bool = doc("Also write outlier: each example's Local Outlier Factor (scikit-learn, 20 neighbours) on "
                         "its embedding's PCA features, the map's; about 1 inside a cluster, higher the more "
                         "isolated.", True)

    def checks(self) -> list[Check]:
        checker = checker_problem(self.checker, "checker") if self.checker is not None else None
        verifier = checker_problem(self.verifier, "verifier") if self.verifier is not None else None
        return [Check("batch_size", self.batch_size >= 1, "must be at least 1"),
                Check("output_dir", bool(self.output_dir.strip()),
                      "must name a folder (empty would write into the current folder)"),
                Check("base_model", self.base_model is None or bool(self.base_model.strip()),
                      "must name a model (or leave it unset)"),
                Check("ifd_model", self.ifd_model is None or bool(self.ifd_model.strip()),
                      "must name a model (or leave it unset)"),
                Check("checker", checker is None, str(checker), got=False),
                Check("checker_max_new_tokens", self.checker_max_new_tokens >= 1, "must be at least 1"),
                Check("verifier", verifier is None, str(verifier), got=False)]


@dataclass
class GenerateConfig(PromptFormat, ModelSource):
    """generation: sampling, and where the prompts come from.

    `gpt4all-training generate`.
    """
    max_new_tokens: int = doc("Most tokens generated per prompt (EOS and stop strings end it sooner).", 256)
    temperature: float = doc("Divides the logits; 0 means greedy (argmax).", 0.7)
    top_p: float = doc("Nucleus sampling: keep the most likely tokens whose probabilities sum to top_p; 1 keeps all.",
                       0.95)
    top_k: int = doc("Keep only the k most likely tokens; 0 keeps all.", 0)
    repetition_penalty: float = doc("CTRL's penalty on tokens already in the prompt or output; 1 disables it.", 1.0)
    stop: list[str] = doc("Stop a response once it contains any of these strings (they are cut off).",
                          factory=list)
    seed: int = doc("Seed of the sampling generator: the same seed and prompts give the same text.", 0)
    batch_size: int = doc("Prompts generated together (left-padded).", 8)
    prompt: Optional[str] = doc("One prompt to answer (or pass --prompt).")
    prompts_file: Optional[PathName] = doc("A file of prompts: one per line, or JSONL with a 'prompt' field "
                                           "(or pass --prompts-file). Output is JSONL.")
    messages_file: Optional[PathName] = doc("Conversations to continue with the assistant's next turn (or pass "
                                            "--messages): a .json file of one ({\"messages\": [...]} or the list), "
                                            "or JSONL of one per line, output as JSONL with the reply appended.")

    def checks(self) -> list[Check]:
        return [
            Check("max_new_tokens", self.max_new_tokens >= 1, "must be at least 1"),
            Check("temperature", self.temperature >= 0, "must be >= 0 (0 is greedy)"),
            Check("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            Check("top_k", self.top_k >= 0, "must be >= 0 (0 keeps all)"),
            Check("repetition_penalty", self.repetition_penalty > 0, "must be > 0 (1 disables it)"),
            Check("batch_size", self.batch_size >= 1, "must be at least 1"),
            Check("prompts_file", not (self.prompt and self.prompts_file),
                  "give either prompt or prompts_file, not both"),
            Check("messages_file", not (self.messages_file and (self.prompt or self.prompts_file)),
                  "give either messages_file or a prompt (prompt, prompts_file), not both"),
            Check("stop", all(self.stop), "empty stop strings would end every response at once; remove them",
                  got=False),
        ]


@dataclass
class TokenizerConfig(TextField, DataSource):
    """tokenizer: the vocabulary to learn and the statistics to report.

    `gpt4all-training tokenizer`: a byte-level BPE trained on the records' text (a Hub dataset is streamed).
    """
    split: str = doc("Split of a Hub dataset.", "train")
    max_examples: Optional[int] = doc("Train on at most this many records; unset: all of them.")
    vocab_size: int = doc("Vocabulary size, special tokens and the 256 byte tokens included.", 32768)
    min_frequency: int = doc("A pair is merged only if it occurs at least this often.", 2)
    special_tokens: list[str] = doc("Special tokens; the first is EOS (and BOS and UNK, as GPT-2's).",
                                    factory=lambda: [EOS])
    split_indentation: bool = doc("Make a line's leading spaces/tabs a piece of their own, so indentation runs "
                                  "can become single tokens (for code). Text still round-trips exactly.", True)
    code_language: Optional[Literal["python"]] = doc("For code: 'python' also reports whether its keywords and "
                                                     "common indentation runs are single tokens.")
    heldout_size: int = doc(f"Records held out of training for the statistics (every {HELDOUT_STRIDE}th record, "
                            f"up to this many); 0: no statistics.", 200)
    output_dir: PathName = doc("Folder the tokenizer is saved to (save_pretrained).", "tokenizers/bpe")

    def checks(self) -> list[Check]:
        n_special = len(self.special_tokens)
        return [
            Check("vocab_size", self.vocab_size >= 256 + n_special,
                  f"must be at least 256 + {n_special} (the byte alphabet and the special tokens)"),
            Check("min_frequency", self.min_frequency >= 1, "must be at least 1"),
            Check("special_tokens", n_special >= 1 and all(self.special_tokens),
                  "needs at least one non-empty token (the first is EOS)"),
            Check("heldout_size", self.heldout_size >= 0, "must be >= 0"),
            at_least_one("max_examples", self.max_examples, " (or unset)"),
        ]
