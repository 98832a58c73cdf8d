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


# The methods through which a tokenizer class may encode otherwise than its backend does (Code Llama's overrides one
# for its infilling prompts): encode_texts leaves a tokenizer that overrides any of them to its own call.
ENCODING_METHODS = ("__call__", "_encode_plus", "set_truncation_and_padding")
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
        return encode_texts(tokenizer, texts, add_special_tokens=True, split_special_tokens=True)
    frame = chat_frame(tokenizer)
    if frame is None:
        texts = [format_prompt(p, tokenizer, template) for p in prompts]
        return tokenizer(texts, add_special_tokens=False)["input_ids"]
    before, after = tokenizer(list(frame), add_special_tokens=False)["input_ids"]
    messages = encode_texts(tokenizer, prompts, add_special_tokens=False, split_special_tokens=True)
    return [before + ids + after for ids in messages]


def encode_texts(tokenizer, texts: list[str], add_special_tokens: bool, split_special_tokens: bool) -> list[list[int]]:
    """The ids `tokenizer(texts, add_special_tokens=..., split_special_tokens=...)["input_ids"]` gives. A fast
    tokenizer that encodes as transformers' own class does is asked for them directly, without the character
    offsets and the per-text dicts its call builds, which nothing here reads."""
    from transformers import PreTrainedTokenizerFast

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or any(getattr(type(tokenizer), name) is not getattr(PreTrainedTokenizerFast, name)
                              for name in ENCODING_METHODS):
        return tokenizer(texts, add_special_tokens=add_special_tokens,
                         split_special_tokens=split_special_tokens)["input_ids"]
    # As transformers' call does: none of the padding or truncation an earlier call may have left in the backend.
    if backend.truncation is not None:
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()
    backend.encode_special_tokens = split_special_tokens
    return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]
