"""Byte-level BPE tokenizer training: every byte is in the initial alphabet, so no text is ever unknown.

`gpt4all-training tokenizer --config configs/tokenizer/x.yaml [key=value ...]` (or `python -m
gpt4all_training.cli tokenizer ...`) streams a dataset's text field (local JSONL, or a Hub dataset at a pinned
revision), trains the tokenizer, saves it with `save_pretrained` (so `AutoTokenizer.from_pretrained(dir)` loads
it) and prints its statistics on held-out records: fertility, the share of words split into pieces, and for code
whether the language's keywords and indentation runs are single tokens.

Indentation. GPT-2's pre-tokenizer glues a newline to the spaces after it and gives the last space to the next
word ("\\n    if" becomes "\\n   " and " if"), so four spaces can never become one token. With `split_indentation` a
line's leading spaces and tabs are a piece of their own first; BPE can then learn "    " as one token. Both ways
round-trip every text exactly: pre-tokenization only decides where merges may happen.
"""

from __future__ import annotations

import json
import keyword
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import Iterable, Iterator, Literal, Optional, Protocol

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from gpt4all_training.config.blocks import EOS, HELDOUT_STRIDE
from gpt4all_training.data.records import iter_texts
from gpt4all_training.errors import UserError
from gpt4all_training.files import atomic_write

# A line's leading run of spaces and tabs (after a newline): isolated before the byte-level split.
INDENTATION = Regex(r"(?<=\n)[ \t]+")
# One entry per code_language choice.
CODE_KEYWORDS = {"python": tuple(keyword.kwlist)}
INDENTATION_RUNS = {"2 spaces": "  ", "4 spaces": " " * 4, "8 spaces": " " * 8, "12 spaces": " " * 12,
                    "1 tab": "\t", "2 tabs": "\t\t"}


class TokenizerSettings(Protocol):
    """What training a tokenizer reads of its config: the records' text (data source, raw text, split, max_examples),
    the vocabulary to learn, and the statistics to report."""
    dataset_path: Optional[str]
    revision: Optional[str]
    text_field: Optional[str]
    split: str
    max_examples: Optional[int]
    vocab_size: int
    min_frequency: int
    special_tokens: list[str]
    split_indentation: bool
    code_language: Optional[Literal["python"]]
    heldout_size: int


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 1000, min_frequency: int = 2,
                        special_tokens: tuple[str, ...] = (EOS,),
                        split_indentation: bool = False) -> PreTrainedTokenizerFast:
    """Train a GPT-2-style byte-level BPE on `texts`. The first special token is EOS."""
    tokenizer = Tokenizer(models.BPE())
    byte_level: pre_tokenizers.PreTokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split_indentation:
        byte_level = pre_tokenizers.Sequence([pre_tokenizers.Split(INDENTATION, behavior="isolated"), byte_level])
    tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    eos = special_tokens[0]
    # Like GPT-J's tokenizer: bos = eos = unk, no pad token (loading sets pad = eos, the case gpt4all got wrong).
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos, bos_token=eos, unk_token=eos,
                                   clean_up_tokenization_spaces=False)


# ---------------------------------------------------------------- data

class HeldOut:
    """Splits a text stream: every HELDOUT_STRIDE-th text (up to `size`) is kept aside, the rest passes through."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.texts: list[str] = []

    def training_texts(self, texts: Iterable[str]) -> Iterator[str]:
        for number, text in enumerate(texts):
            if len(self.texts) < self.size and number % HELDOUT_STRIDE == 0:
                self.texts.append(text)
            elif text:
                yield text


# ---------------------------------------------------------------- statistics

def single_token(tokenizer, text: str, context: tuple[str, str]) -> bool:
    """Whether `text`, written between `context[0]` and `context[1]`, is exactly one of the encoded tokens."""
    before, after = context
    ids = tokenizer.encode(before + text + after, add_special_tokens=False)
    pieces = [tokenizer.decode([i], clean_up_tokenization_spaces=False) for i in ids]
    return text in pieces


def words_of(tokenizer, text: str) -> list[str]:
    """The pre-tokenizer's pieces of `text` that hold a letter or digit: what the statistics call words."""
    pre_tokenizer = tokenizer.backend_tokenizer.pre_tokenizer
    if pre_tokenizer is None:
        return [w for w in text.split() if any(ch.isalnum() for ch in w)]
    pieces = pre_tokenizer.pre_tokenize_str(text)
    return [piece for piece, (start, end) in pieces if any(ch.isalnum() for ch in text[start:end])]


@dataclass
class TokenizerStats:
    texts: int
    tokens: int
    words: int
    fertility: float  # tokens per word
    split_share: float  # words that became 2+ tokens
    keywords_line_start: Optional[dict[str, bool]] = None  # `if` at the start of a line: one token?
    keywords_after_space: Optional[dict[str, bool]] = None  # ` if` after a space: one token?
    indentation: Optional[dict[str, bool]] = None  # a line's indentation run: one token?

    def describe(self) -> str:
        lines = [f"held-out sample: {self.texts} texts, {self.words:,} words, {self.tokens:,} tokens",
                 f"fertility: {self.fertility:.3f} tokens per word (words: pre-tokenizer pieces with a letter or "
                 f"digit)",
                 f"words split into 2+ tokens: {100 * self.split_share:.1f}%"]
        for name, table in (("keywords at line start", self.keywords_line_start),
                            ("keywords after a space", self.keywords_after_space)):
            if table is not None:
                missing = [k for k, single in table.items() if not single]
                lines.append(f"{name} that are one token: {len(table) - len(missing)}/{len(table)}"
                             + (f" (not: {', '.join(missing)})" if missing else ""))
        if self.indentation is not None:
            lines.append("indentation runs that are one token: "
                         + ", ".join(f"{name} {'yes' if single else 'no'}"
                                     for name, single in self.indentation.items()))
        return "\n".join(lines)


def tokenizer_stats(tokenizer, texts: list[str], code_language: Optional[str] = None) -> TokenizerStats:
    """Fertility and split share over `texts`; with a code language, its keywords and indentation runs."""
    model = tokenizer.backend_tokenizer.model
    n_tokens = n_words = n_split = 0
    for text in texts:
        n_tokens += len(tokenizer.encode(text, add_special_tokens=False))
        for word in words_of(tokenizer, text):
            n_words += 1
            n_split += len(model.tokenize(word)) >= 2
    stats = TokenizerStats(texts=len(texts), tokens=n_tokens, words=n_words, fertility=n_tokens / max(n_words, 1),
                           split_share=n_split / max(n_words, 1))
    if code_language:
        keywords = CODE_KEYWORDS[code_language]
        stats.keywords_line_start = {k: single_token(tokenizer, k, ("x\n", " y")) for k in keywords}
        stats.keywords_after_space = {k: single_token(tokenizer, " " + k, ("x", " y")) for k in keywords}
        stats.indentation = {name: single_token(tokenizer, run, ("x:\n", "y"))
                             for name, run in INDENTATION_RUNS.items()}
    return stats


# ---------------------------------------------------------------- the command

def build_tokenizer(config: TokenizerSettings) -> tuple[PreTrainedTokenizerFast, Optional[TokenizerStats]]:
    """Train on the configured stream (held-out records excluded) and measure on the held-out records."""
    assert config.dataset_path is not None  # validate() refuses a config without it
    held_out = HeldOut(config.heldout_size)
    texts = held_out.training_texts(iter_texts(config.dataset_path, config.revision, config.text_field,
                                               config.split))
    if config.max_examples:
        texts = islice(texts, config.max_examples)
    tokenizer = train_bpe_tokenizer(texts, config.vocab_size, config.min_frequency, tuple(config.special_tokens),
                                    config.split_indentation)
    if tokenizer.vocab_size <= 256 + len(config.special_tokens):
        raise UserError(f"dataset_path {config.dataset_path}: no merges learned: the records have no text (check "
                        f"text_field), or no pair of tokens occurs min_frequency ({config.min_frequency}) times")
    sample = [t for t in held_out.texts if t]
    stats = tokenizer_stats(tokenizer, sample, config.code_language) if sample else None
    return tokenizer, stats


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, stats: Optional[TokenizerStats], output_dir: Path) -> None:
    """`save_pretrained` into `output_dir`, with the statistics (when there are any) as tokenizer_stats.json."""
    tokenizer.save_pretrained(output_dir)
    if stats is not None:
        atomic_write(output_dir / "tokenizer_stats.json", json.dumps(asdict(stats), indent=1))
