"""Chat prompts for the server: the ids training encodes (data/chat.py), with the API's errors."""

from __future__ import annotations

from gpt4all_training.data.chat import ChatEncoder, end_of_turn_id
from gpt4all_training.errors import UserError
from gpt4all_training.serving.protocol import APIError


def render(encoder: ChatEncoder | None, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` through the chat template, ending with the prompt of the assistant's turn: the ids
    a trained model saw in training, control-token text typed by a user included (sanitized, never special)."""
    if encoder is None:
        raise APIError(400, "This model's tokenizer has no chat template; use /v1/completions.", param="messages")
    [ids] = encoder.encode([messages], [True])
    if ids is None:  # the template's own raise_exception(), e.g. roles must alternate
        raise APIError(400, "messages: the chat template refuses them (roles it cannot render, such as two user "
                            "turns in a row)", param="messages")
    return ids


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
