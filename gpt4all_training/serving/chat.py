"""Chat prompts for the server: the ids training encodes (data/chat.py), the tools offered included, with the API's
errors."""

from __future__ import annotations

from typing import Any, Optional

from gpt4all_training.data.chat import PART_WORDS, ChatEncoder, end_of_turn_id
from gpt4all_training.errors import UserError
from gpt4all_training.serving.protocol import APIError
from gpt4all_training.serving.reasoning import CLOSE, OPEN


def render(encoder: ChatEncoder | None, messages: list[dict[str, Any]],
           tools: Optional[list[dict[str, Any]]] = None) -> list[int]:
    """Token ids of `messages` (and the `tools` they offer) through the chat template, ending with the prompt of the
    assistant's turn: the ids a trained model saw in training, control-token text typed by a user included
    (sanitized, never special). 400 where the template refuses the conversation or leaves out of its text the
    tools, tool calls or messages of a role given (as training refuses them); reasoning of earlier turns a template
    leaves out is what reasoning models expect."""
    if encoder is None:
        raise APIError(400, "This model's tokenizer has no chat template; use /v1/completions.", param="messages")
    part = encoder.unrendered_part(messages, tools, reasoning=False)
    if part:
        what = PART_WORDS.get(part, f"{part!r} messages")
        param = "tools" if part == "tools" else "messages"
        raise APIError(400, f"{param}: this model's chat template does not render {what}, so the model would not "
                            f"see them; send the request without them", param=param)
    [ids] = encoder.encode([messages], [True], [tools])
    if ids is None:  # the template's own raise_exception(), e.g. roles must alternate
        raise APIError(400, "messages: the chat template refuses them (roles it cannot render, such as two user "
                            "turns in a row)", param="messages")
    return ids


def opens_reasoning(encoder: ChatEncoder, messages: list[dict[str, Any]],
                    tools: Optional[list[dict[str, Any]]] = None) -> bool:
    """Whether the template's generation prompt opens a <think> block that the reply continues (Qwen3
    Thinking-2507's and DeepSeek-R1's do), found from what the generation prompt adds to the conversation's text."""
    prompted, closed = (encoder.render(messages, tools, generation_prompt=flag) for flag in (True, False))
    if prompted is None or closed is None or not prompted.startswith(closed):
        return False
    added = prompted[len(closed):]
    return added.rfind(OPEN) > added.rfind(CLOSE)


def chat_encoder(tokenizer) -> ChatEncoder | None:
    """The encoder for /v1/chat/completions; None for a tokenizer without a chat template (completions only)."""
    return ChatEncoder(tokenizer) if getattr(tokenizer, "chat_template", None) else None


def end_of_turn_ids(tokenizer) -> set[int]:
    """The special token that ends an assistant turn (ChatML's <|im_end|>, Llama 3's <|eot_id|>, ...), which a model
    trained on the template stops with; empty without a template or where the template writes none."""
    if not getattr(tokenizer, "chat_template", None):
        return set()
    try:
        return {end_of_turn_id(tokenizer)}
    except UserError:  # a template training refuses still serves; its replies end at EOS
        return set()
