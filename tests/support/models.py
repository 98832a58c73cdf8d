"""The tiny GPT-J the tests train, the chat template they add to tokenizers, and reading saved weights back."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tiny_gptj(tokenizer, seed: int = 0):
    """A 2-layer, width-64 GPT-J over `tokenizer`'s vocabulary, initialized from `seed`."""
    from transformers import GPTJConfig, GPTJForCausalLM

    torch.manual_seed(seed)
    config = GPTJConfig(vocab_size=len(tokenizer), n_positions=512, n_embd=64, n_layer=2, n_head=4, rotary_dim=16,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        tie_word_embeddings=False)
    return GPTJForCausalLM(config)


def weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the *.safetensors files in `folder` (a model folder holds at least one)."""
    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    assert tensors, f"no safetensors in {folder}"
    return tensors
