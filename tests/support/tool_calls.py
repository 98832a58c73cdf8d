"""Conversations with tool calls, and a ChatML template that renders them (the `chat_tokenizer`'s template, like
SmolLM2's, writes only each message's content, so a tool call would vanish from it)."""

from __future__ import annotations

import json

# Each tool call as <tool_call>{"name": ..., "arguments": ...}</tool_call> after the content, as Qwen2.5's does.
TOOL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] or '' }}"
    "{% for call in message.get('tool_calls') or [] %}<tool_call>{\"name\": \"{{ call['function']['name'] }}\", "
    "\"arguments\": {{ call['function']['arguments'] | tojson }}}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def weather_call(city: str, number: int) -> dict:
    return {"id": f"call_{number}", "type": "function",
            "function": {"name": "weather", "arguments": json.dumps({"city": city})}}


def tool_conversations() -> list[dict]:
    """OpenAI-format records: a tool call answered by a tool turn, then the answer; one keeps a first answer as
    context only ("train": false)."""
    rows = []
    for number, (city, weather) in enumerate([("Paris", "18 C, sunny"), ("Oslo", "2 C, snow"),
                                              ("Lima", "20 C, cloudy"), ("Rome", "25 C, clear")]):
        rows.append({"messages": [
            {"role": "system", "content": "You can look up the weather."},
            {"role": "user", "content": f"Weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [weather_call(city, number)]},
            {"role": "tool", "tool_call_id": f"call_{number}", "name": "weather", "content": weather},
            {"role": "assistant", "content": f"In {city}: {weather}."}]})
    rows[1]["messages"][4]["train"] = False
    rows[1]["messages"] += [{"role": "user", "content": "And tomorrow?"}, {"role": "assistant", "content": "Snow."}]
    return rows
