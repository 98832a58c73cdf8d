"""What the data package reads of a config: the fields, not the config.

Each loader takes the fields it reads as a protocol, so that a type checker holds it to them and nothing in data/
names a config class (tests/test_imports.py): a `TrainConfig` satisfies every one, an `InferenceConfig` those of its
blocks. The types are the config fields' own (config/blocks.py), as a protocol's attributes must match exactly.
"""

from __future__ import annotations

from typing import Literal, Optional, Protocol

from gpt4all_training.config.blocks import ObjectiveName, PromptTemplate


class DataSettings(Protocol):
    """What tokenizing records into a train and a validation split reads: where the records are (data source), how
    they become examples (examples) and how a prompt is written (prompt)."""
    dataset_path: Optional[str]
    revision: Optional[str]
    streaming: bool
    num_proc: int
    max_length: int
    val_fraction: float
    seed: int
    train_turns: Literal["all", "last"]
    train_reasoning: bool
    prompt_template: PromptTemplate


class CacheLocation(Protocol):
    """Where the tokenized data is cached (checkpoints)."""
    cache_dir: Optional[str]
    output_dir: str


class CachedDataSettings(DataSettings, CacheLocation, Protocol):
    """DataSettings, with which objective's examples they make and where the cache is."""
    objective: ObjectiveName


class RawTextSettings(DataSettings, Protocol):
    """DataSettings, with the raw-text field, the rows' shuffle buffer, and the validation rows evaluation reads
    (eval_steps batches of batch_size rows per process)."""
    text_field: Optional[str]
    shuffle_buffer: int
    eval_steps: Optional[int]
    batch_size: int
