"""The architecture matrix's tiny models: one config per family people fine-tune, with the features of its released
models that change what training, decoding or export must do, at 2 layers and width 64 (4 heads of 16).

What each family brings (FAMILIES says it in short, for the matrix table):
- llama3: GQA and Llama 3.1's `llama3` RoPE scaling (low and high frequencies scaled apart);
- qwen2.5: biases on q/k/v, tied embeddings;
- qwen3: qk-norm, a head_dim of its own, tied embeddings;
- mistral: a sliding window (Mistral 7B v0.1's), shorter than the rows here, so it changes the attention;
- gemma2: alternating sliding-window and full layers, attention and final logit soft-capping, GeGLU, the embedding
  scaled by sqrt(width), norms around each block, query_pre_attn_scalar, tied embeddings;
- gemma3: Gemma 3's text model: qk-norm, a local RoPE base for the sliding layers and linear RoPE scaling for the
  full ones, the embedding scale, tied embeddings;
- phi3: fused qkv_proj and gate_up_proj, partial rotary (Phi-4-mini's 0.75), tied embeddings;
- smollm2: the Llama architecture with tied embeddings and GQA (SmolLM2-135M's shape);
- smollm3: NoPE layers (every layer in no_rope_layers with 0 runs without RoPE), tied embeddings;
- pythia: GPT-NeoX with a quarter of each head rotary, parallel residual, fused query_key_value with biases;
- gptj: GPT-J (the project's seed model), partial rotary, parallel residual, biased head.
"""

from __future__ import annotations

import torch

WIDTH = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
SLIDING_WINDOW = 8  # shorter than the conversations trained here, so a windowed layer differs from a full one

# family -> (what people call the models it stands for, what its tiny model has)
FAMILIES = {
    "llama3": ("Llama 3.1 / 3.2", "GQA, RoPE type llama3"),
    "qwen2.5": ("Qwen2.5", "GQA, q/k/v biases, tied embeddings"),
    "qwen3": ("Qwen3", "GQA, qk-norm, head_dim, tied embeddings"),
    "mistral": ("Mistral", "GQA, sliding window"),
    "gemma2": ("Gemma 2", "GQA, sliding/full layers, logit soft-capping, embedding scale, tied embeddings"),
    "gemma3": ("Gemma 3 (text)", ("GQA, sliding/full layers, qk-norm, local RoPE base, linear RoPE scaling, tied "
                                  "embeddings")),
    "phi3": ("Phi-3 / Phi-4-mini", "fused qkv/gate_up, partial rotary, tied embeddings"),
    "smollm2": ("SmolLM2", "Llama architecture, GQA, tied embeddings"),
    "smollm3": ("SmolLM3", "GQA, NoPE layers, tied embeddings"),
    "pythia": ("Pythia (GPT-NeoX)", "partial rotary, parallel residual, fused qkv with biases"),
    "gptj": ("GPT-J", "partial rotary, parallel residual, biased head"),
}


def family_config(family: str, vocab_size: int, bos: int, eos: int):
    """The config of `family`'s tiny model over a vocabulary of `vocab_size` (the chat tokenizer's)."""
    import transformers as tf

    common = dict(vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos)
    window = dict(sliding_window=SLIDING_WINDOW)
    gemma = dict(head_dim=16, query_pre_attn_scalar=16, **window)
    if family == "llama3":
        return tf.LlamaConfig(**common, **WIDTH, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    if family == "qwen2.5":
        return tf.Qwen2Config(**common, **WIDTH, tie_word_embeddings=True)
    if family == "qwen3":
        return tf.Qwen3Config(**common, **WIDTH, head_dim=32, tie_word_embeddings=True)
    if family == "mistral":
        return tf.MistralConfig(**common, **WIDTH, **window, tie_word_embeddings=False)
    if family == "gemma2":
        return tf.Gemma2Config(**common, **WIDTH, **gemma, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    if family == "gemma3":
        return tf.Gemma3TextConfig(**common, **WIDTH, **gemma, layer_types=["sliding_attention", "full_attention"],
                                   rope_parameters={
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                       "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                          "rope_theta": 1000000.0}})
    if family == "phi3":
        return tf.Phi3Config(**common, **{**WIDTH, "num_key_value_heads": 4}, pad_token_id=eos, tie_word_embeddings=True,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.75})
    if family == "smollm2":
        return tf.LlamaConfig(**common, **WIDTH, tie_word_embeddings=True)
    if family == "smollm3":
        return tf.SmolLM3Config(**common, **WIDTH, no_rope_layers=[1, 0], pad_token_id=eos, tie_word_embeddings=True)
    if family == "pythia":
        return tf.GPTNeoXConfig(**common, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                num_attention_heads=4, max_position_embeddings=128, tie_word_embeddings=False,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                 "partial_rotary_factor": 0.25})
    if family == "gptj":
        return tf.GPTJConfig(**common, n_positions=128, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                             tie_word_embeddings=False)
    raise KeyError(family)


def build_family_model(family: str, tokenizer, seed: int = 0):
    """`family`'s tiny model over `tokenizer`'s vocabulary, initialized from `seed`, with non-trivial norm weights
    and biases (random ones start at 1 and 0, where a misplaced norm or bias would not show)."""
    from transformers import AutoModelForCausalLM

    config = family_config(family, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                # Gemma's norms scale by 1 + weight: around 0 there, around 1 elsewhere
                centre = 0.0 if "gemma" in config.model_type or "norm" not in name else 1.0
                param.copy_(centre + 0.2 * torch.randn_like(param))
    return model
