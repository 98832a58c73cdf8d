"""Chat prompts: rendering messages with the tokenizer's chat template, and the token that ends an assistant turn."""

from __future__ import annotations

from gpt4all_training.serving.protocol import APIError

SENTINEL = "0b7c9e1f-assistant-reply"  # text no template produces itself, to find what follows a reply


def render(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` through the chat template, ending with the prompt of the assistant's turn."""
    if not tokenizer.chat_template:
        raise APIError(400, "This model's tokenizer has no chat template; use /v1/completions.", param="messages")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # jinja's TemplateError, or a template's own raise_exception() (e.g. roles must alternate)
        raise APIError(400, f"messages: the chat template refused them ({exc})", param="messages") from None
    # The template writes the special tokens (BOS, turn markers) itself.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def end_of_turn_ids(tokenizer) -> set[int]:
    """The special token the chat template writes right after an assistant reply (ChatML's <|im_end|>, Llama 3's
    <|eot_id|>, ...): a model trained on the template ends its turn with it. Empty when there is no template or
    no special token follows the reply."""
    if not tokenizer.chat_template:
        return set()
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": SENTINEL}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # a template that cannot render this conversation has no end-of-turn to learn from it
        return set()
    after = text.partition(SENTINEL)[2]
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    return {ids[0]} if ids and ids[0] in tokenizer.all_special_ids else set()
