"""Byte-level BPE tokenizer training: every byte is in the initial alphabet, so no text is ever unknown."""

from __future__ import annotations

from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 1000, min_frequency: int = 2,
                        special_tokens: tuple[str, ...] = (EOS,)) -> PreTrainedTokenizerFast:
    """Train a GPT-2-style byte-level BPE on `texts`. The first special token is EOS."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    eos = special_tokens[0]
    # Like GPT-J's tokenizer: bos = eos = unk, no pad token (loading sets pad = eos, the case gpt4all got wrong).
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos, bos_token=eos, unk_token=eos)
