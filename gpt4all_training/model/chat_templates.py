"""The `chat_template` option: a Jinja file or a built-in template that replaces the tokenizer's own.

Built-in templates write only tokens the tokenizer already has as special tokens; a tokenizer without them is
refused, because the project never adds tokens (a new embedding row would be untrained) and a marker tokenized as
plain text could not end a turn.
"""

from __future__ import annotations

from pathlib import Path

from gpt4all_training.errors import UserError

# ChatML (OpenAI's; SmolLM2's and Qwen's without their default system message): <|im_start|>role\ncontent<|im_end|>\n
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
BUILT_IN = {"chatml": (CHATML, ("<|im_start|>", "<|im_end|>"))}


def resolve_chat_template(value: str, tokenizer) -> str:
    """The Jinja text `value` names: a built-in template (checked against the tokenizer's tokens) or a file."""
    if value in BUILT_IN:
        template, tokens = BUILT_IN[value]
        special = {token.content for token in tokenizer.added_tokens_decoder.values() if token.special}
        missing = [token for token in tokens if token not in special]
        if missing:
            raise UserError(f"chat_template: {value!r} needs {' and '.join(missing)} as special tokens, and this "
                            f"tokenizer has none; give a Jinja file written in the tokenizer's own special tokens")
        return template
    path = Path(value).expanduser()
    if not path.is_file():
        raise UserError(f"chat_template: {value} is neither a file nor a built-in template "
                        f"({', '.join(BUILT_IN)}); give a Jinja file or {', '.join(map(repr, BUILT_IN))}")
    return path.read_text(encoding="utf-8")


def apply_chat_template_option(tokenizer, value: str | None):
    """`tokenizer` with `chat_template` set from the option; unchanged when it is unset."""
    if value:
        tokenizer.chat_template = resolve_chat_template(value, tokenizer)
    return tokenizer
