"""The chat template an export carries, so that every reader renders and stops as training did.

- GGUF: `tokenizer.chat_template` (llama.cpp, GPT4All and Ollama read it) and `tokenizer.ggml.eot_token_id`, the
  template's end-of-turn token (gguf.py writes both).
- Slim HF folder: the template in tokenizer_config.json as well as chat_template.jinja (transformers 5 reads the
  file; older transformers, vLLM and TGI read the config), and the end-of-turn token among generation_config.json's
  EOS ids, so `generate` stops where a turn ends.
- Sampling: the settings the model was evaluated with (SAMPLING: greedy, no repetition penalty, as `generate` and
  `eval` default to) go into the GGUF (general.sampling.*, which llama.cpp's tools take as defaults), the Modelfile
  (PARAMETER) and the model card. Clients' own defaults change answers: GPT4All's repeat penalty of 1.18 turned the
  demo model's "4000" into "10527689300".
- Ollama: a Modelfile beside the GGUF. Ollama templates are Go templates, not Jinja; a ChatML template (checked by
  rendering sample conversations both ways) becomes Ollama's ChatML template, with the template's default system
  message as SYSTEM, which Ollama puts first when a conversation has none, as the Jinja template does. Another
  template is left for Ollama to match against those it knows from the GGUF's metadata (said in the file).
"""

from __future__ import annotations

import json
from pathlib import Path

from gpt4all_training.data.chat import end_of_turn_id
from gpt4all_training.errors import UserError

OLLAMA_CHATML = ("{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
                 "<|im_start|>assistant\n")
# Conversations rendered by the Jinja template and by plain ChatML; equal renderings of all of them make it ChatML.
PROBES = [
    ([{"role": "user", "content": "Q1"}], True),
    ([{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"}], False),
    ([{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
      {"role": "user", "content": "Q2"}], True),
    ([{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"}, {"role": "tool", "content": "T1"},
      {"role": "assistant", "content": "A2"}], False),
]
SYSTEM_HEADER = "<|im_start|>system\n"
# The sampling the model was evaluated with: the defaults of generation/generate.py's Sampling (export may not import
# that stage; tests/test_gguf.py checks the two agree), by their names in GGUF's general.sampling.* keys.
SAMPLING = {"temp": 0.0, "top_k": 0, "top_p": 1.0, "penalty_repeat": 1.0}
# The same settings by Ollama's PARAMETER names.
OLLAMA_SAMPLING = {"temperature": "temp", "top_k": "top_k", "top_p": "top_p", "repeat_penalty": "penalty_repeat"}


def template_end_of_turn(tokenizer) -> int | None:
    """The template's end-of-turn token id; None without a template, or with one whose turns end in no special
    token (an export still carries such a template, and readers stop at EOS)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        return end_of_turn_id(tokenizer)
    except UserError:
        return None


def stop_token_ids(tokenizer) -> list[int]:
    """EOS, then the end-of-turn token when it is another token."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    eot = template_end_of_turn(tokenizer)
    return ids + [eot] if eot is not None and eot not in ids else ids


def chatml(messages: list[dict], generation_prompt: bool, default_system: str | None) -> str:
    if default_system is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": default_system}, *messages]
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if generation_prompt else "")


def chatml_default_system(tokenizer) -> tuple[bool, str | None]:
    """(whether the tokenizer's template renders ChatML, the system message it writes when a conversation has
    none: None when it writes none)."""
    from jinja2 import TemplateError

    def render(messages: list[dict], generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)

    try:
        first = render(*PROBES[0])
        default_system = None
        if first.startswith(SYSTEM_HEADER) and "<|im_end|>\n" in first:
            default_system = first[len(SYSTEM_HEADER):first.index("<|im_end|>\n")]
        same = all(render(messages, prompt) == chatml(messages, prompt, default_system) for messages, prompt in PROBES)
    except TemplateError:
        return False, None
    return same, default_system


def ollama_modelfile(gguf_name: str, tokenizer) -> str:
    """An Ollama Modelfile for the GGUF file `gguf_name` in the same folder."""
    lines = [f"FROM ./{gguf_name}"]
    is_chatml, default_system = chatml_default_system(tokenizer) if tokenizer.chat_template else (False, None)
    if is_chatml:
        if default_system is not None:
            lines.append(f'SYSTEM """{default_system}"""')
        lines.append(f'TEMPLATE """{OLLAMA_CHATML}"""')
    else:
        lines.append("# No TEMPLATE: only ChatML chat templates are translated to Ollama's Go templates. Ollama picks "
                     "its template by matching the GGUF's tokenizer.chat_template against those it knows.")
    for token in tokenizer.convert_ids_to_tokens(stop_token_ids(tokenizer)):
        lines.append(f"PARAMETER stop {json.dumps(token)}")
    lines += [f"PARAMETER {name} {SAMPLING[key]:g}" for name, key in OLLAMA_SAMPLING.items()]
    return "\n".join(lines) + "\n"


def sampling_card(pre_tokenizer: str | None) -> list[str]:
    """The model card's section on how to run the GGUF: the sampling it was evaluated with, and which readers
    know its pre-tokenizer."""
    settings = ", ".join(f"{name} {SAMPLING[key]:g}" for name, key in OLLAMA_SAMPLING.items())
    lines = ["", "## Running the GGUF", "",
             f"Evaluated with {settings} (greedy, no repetition penalty). The file and the Modelfile carry these "
             f"settings; set them in clients that use defaults of their own: GPT4All's repeat penalty of 1.18 "
             f"changes answers (it turned a correct `4000` into `10527689300`)."]
    if pre_tokenizer:
        lines += ["", f"The file declares the pre-tokenizer `{pre_tokenizer}` (`tokenizer.ggml.pre`). A llama.cpp "
                      f"build older than that name refuses the file (\"unknown pre-tokenizer type\"): the gpt4all "
                      f"2.8.2 Python client (mid-2024 llama.cpp) reads `gpt-2` but refuses `smollm`."]
    return lines


def add_template_to_tokenizer_config(folder: Path, tokenizer) -> None:
    """tokenizer_config.json gains the chat template that save_pretrained wrote only to chat_template.jinja."""
    if not isinstance(tokenizer.chat_template, str):
        return
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["chat_template"] = tokenizer.chat_template
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
