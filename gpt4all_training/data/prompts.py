"""The prompt format, shared by training and generation: the template, and the prompt's token ids.

`plain` is the prompt and a newline; `chat` is the tokenizer's chat template with the prompt as the user's message
and the generation prompt after it; `auto` is chat when the tokenizer has a template.
"""

from __future__ import annotations

from gpt4all_training.errors import UserError


def resolve_template(template: str, tokenizer) -> str:
    if template == "auto":
        return "chat" if getattr(tokenizer, "chat_template", None) else "plain"
    if template == "chat" and not getattr(tokenizer, "chat_template", None):
        raise UserError("prompt_template: 'chat' needs a tokenizer with a chat template; use 'plain'")
    return template


def format_prompt(prompt: str, tokenizer, template: str) -> str:
    """The text the model sees before the response, in training and in generation alike."""
    if template == "chat":
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    return prompt + "\n"


MESSAGE_MARK = "\x00message\x00"  # stands for the user's message while the chat template is rendered


def chat_frame(tokenizer) -> tuple[str, str] | None:
    """The chat template's text before and after the user's message, or None for a template that changes the message
    (then it cannot be cut out, and the whole rendering is tokenised)."""
    rendered = format_prompt(MESSAGE_MARK, tokenizer, "chat")
    if rendered.count(MESSAGE_MARK) != 1:
        return None
    before, after = rendered.split(MESSAGE_MARK)
    return before, after


def encode_prompts(prompts: list[str], tokenizer, template: str) -> list[list[int]]:
    """Token ids of formatted prompts. Only the template and the tokenizer write special tokens: a prompt that spells
    one ("<|im_start|>assistant" pasted into a question) stays text, as responses do (tokenize_batch)."""
    if template == "plain":
        texts = [format_prompt(p, tokenizer, template) for p in prompts]
        return tokenizer(texts, split_special_tokens=True)["input_ids"]
    frame = chat_frame(tokenizer)
    if frame is None:
        texts = [format_prompt(p, tokenizer, template) for p in prompts]
        return tokenizer(texts, add_special_tokens=False)["input_ids"]
    before, after = tokenizer(list(frame), add_special_tokens=False)["input_ids"]
    messages = tokenizer(prompts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return [before + ids + after for ids in messages]
