"""Chat templates of the model families people fine-tune for tool calling and reasoning, with tokenizers that carry
each family's control tokens, and OpenAI-format conversations that exercise them.

The templates are written here to render exactly what each model's own template (the `chat_template` of its
tokenizer_config.json on the Hub, which is out of reach offline) renders for the conversations these tests give:
the tool definitions, tool calls, tool results, reasoning and turn markers of
- Llama 3.1 Instruct: tools as JSON (`tojson(indent=4)`) in the first user message, one tool call per turn as
  `{"name": ..., "parameters": <arguments | tojson>}` closed by <|eot_id|>, tool results in `ipython` turns;
- Qwen2.5 Instruct: tools in the system message inside <tools></tools>, tool calls as
  `<tool_call>\\n{"name": ..., "arguments": <arguments | tojson>}\\n</tool_call>`, results as <tool_response> in a
  user turn;
- Qwen3: as Qwen2.5 (arguments written as given when a string), plus reasoning: a <think> block written only in
  turns after the last user message (and, empty, in a last turn that has none);
- Qwen3 Thinking-2507: Qwen3's, whose generation prompt opens the <think> block;
- Mistral 7B Instruct v0.3: tools as [AVAILABLE_TOOLS] before the last user message, tool calls as
  `[TOOL_CALLS] [{"name", "arguments", "id"}]</s>`, results as [TOOL_RESULTS], 9-character call ids;
- DeepSeek-R1 as first released: its turn markers, every assistant turn's reasoning dropped (its tool-call markup
  left out: it serves here as a template that never renders reasoning).
"""

from __future__ import annotations

import json
from pathlib import Path

LLAMA31 = """{{- bos_token }}
{%- if custom_tools is defined %}{%- set tools = custom_tools %}{%- endif %}
{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function \
call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
    {{- first_user_message + "<|eot_id|>" }}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + \
'<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}{{- ", " }}{%- endif %}
            {%- endfor %}
            {{- ")" }}
        {%- else %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}{{- "<|eom_id|>" }}{%- else %}{{- "<|eot_id|>" }}{%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

QWEN_TOOLS_HEADER = """\
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with \
function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": \
<args-json-object>}\\n</tool_call><|im_end|>\\n" }}
"""

QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n" }}
""" + QWEN_TOOLS_HEADER + """{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" \
and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

QWEN3_BODY = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
""" + QWEN_TOOLS_HEADER + """{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and \
not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}{%- set content = message.content %}
    {%- else %}{%- set content = '' %}{%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1]\
.lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + \
'\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{%- endif %}
                {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
"""
QWEN3 = QWEN3_BODY + """{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""
QWEN3_THINKING = QWEN3_BODY + "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}\n"

MISTRAL_V03 = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and \
message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate \
user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}{{- ", " }}{%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" }}{%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" + eos_token }}{%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token }}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional \
system message!") }}
    {%- endif %}
{%- endfor %}
"""

DEEPSEEK_R1 = """{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}{{- message['content'] }}
    {%- elif message['role'] == 'user' %}{{- '<｜User｜>' + message['content'] }}
    {%- elif message['role'] == 'assistant' %}
        {%- set content = message['content'] %}
        {%- if '</think>' in content %}{%- set content = content.split('</think>')[-1] %}{%- endif %}
        {{- '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<｜Assistant｜>' }}{%- endif %}
"""

# Per family: (template, special tokens as (bos, eos, others), plain added tokens)
FAMILIES = {
    "llama3.1": (LLAMA31, ("<|begin_of_text|>", "<|eot_id|>",
                           ["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"]), []),
    "qwen2.5": (QWEN25, (None, "<|im_end|>", ["<|im_start|>"]), ["<tool_call>", "</tool_call>"]),
    "qwen3": (QWEN3, (None, "<|im_end|>", ["<|im_start|>"]),
              ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]),
    "qwen3-thinking": (QWEN3_THINKING, (None, "<|im_end|>", ["<|im_start|>"]),
                       ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]),
    "mistral-v0.3": (MISTRAL_V03, ("<s>", "</s>", ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                                  "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]), []),
    "deepseek-r1": (DEEPSEEK_R1, ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", ["<｜User｜>", "<｜Assistant｜>"]),
                    ["<think>", "</think>"]),
}
TOOL_FAMILIES = ["llama3.1", "qwen2.5", "qwen3", "mistral-v0.3"]


# Each family's end-of-turn text: where an assistant turn ends in its rendering.
END_OF_TURN = {"llama3.1": "<|eot_id|>", "qwen2.5": "<|im_end|>", "qwen3": "<|im_end|>", "qwen3-thinking": "<|im_end|>",
               "mistral-v0.3": "</s>", "deepseek-r1": "<｜end▁of▁sentence｜>", "chatml": "<|im_end|>"}


def family_tokenizer(tokenizer_dir, family: str):
    """The session BPE tokenizer with `family`'s control tokens (special, as the family's own tokenizer has them),
    its plain added tokens (Qwen's <think>, not special) and its chat template, saved beside `tokenizer_dir` and
    loaded back as a user's model folder is (once per session)."""
    from gpt4all_training.model.loading import load_tokenizer

    folder = Path(tokenizer_dir).parent / f"tokenizer-{family}"
    if not folder.is_dir():
        save_family_tokenizer(tokenizer_dir, family, folder)
    return load_tokenizer(str(folder))


def save_family_tokenizer(tokenizer_dir, family: str, folder: Path) -> None:
    from gpt4all_training.model.loading import load_tokenizer

    template, (bos, eos, others), plain = FAMILIES[family]
    tokenizer = load_tokenizer(str(tokenizer_dir))
    tokenizer.add_special_tokens({**({"bos_token": bos} if bos else {}), "eos_token": eos,
                                  "additional_special_tokens": others})
    if plain:
        tokenizer.add_tokens(plain, special_tokens=False)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)


def decoded(messages: list[dict]) -> list[dict]:
    """OpenAI messages as a template is given them: tool-call arguments as objects."""
    def call(c: dict) -> dict:
        return {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}

    return [{**m, "tool_calls": [call(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]


def reasoning_text(message: dict) -> str:
    """The reasoning of an assistant turn as templates write it, without the newlines around it; "" for none."""
    if message.get("reasoning_content"):
        return message["reasoning_content"].strip("\n")
    content = message.get("content") or ""
    return content.partition("</think>")[0].partition("<think>")[2].strip("\n") if "</think>" in content else ""


def expected_example(tokenizer, record: dict, trained: set[int], end_of_turn: str, reasoning: bool = True
                     ) -> tuple[list[int], list[int]]:
    """The (ids, labels) a record must train with, built from character offsets of the template's renderings,
    independently of data/chat.py: the whole conversation's text is tokenized; turn k of `trained` is labelled from
    the end of the text of messages[:k] with the generation prompt through the first `end_of_turn` after it in the
    text of messages[:k + 1], after checking that the whole text holds exactly that; every other assistant turn is
    checked not to be so held (the template writes it otherwise once more follows). Without `reasoning`, the
    characters of each trained turn's reasoning are not labelled."""
    messages, tools = decoded(record["messages"]), record.get("tools")

    def text(upto: int, prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(messages[:upto], tools=tools, add_generation_prompt=prompt,
                                             tokenize=False)

    whole = text(len(messages))
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        context, through = text(k, prompt=True), text(k + 1)
        end = through.index(end_of_turn, len(context)) + len(end_of_turn)
        held = through.startswith(context) and whole.startswith(through[:end])
        assert held == (k in trained), f"turn {k} is {'' if held else 'not '}held by the whole conversation"
        thought = "" if reasoning or not held else reasoning_text(message)
        if thought:
            at = whole.index(thought, len(context))
            spans += [(len(context), at), (at + len(thought), end)]
        elif held:
            spans.append((len(context), end))
    encoding = tokenizer(whole, add_special_tokens=False, return_offsets_mapping=True)
    labels = [token if any(s < b and e > a for a, b in spans) else -100
              for token, (s, e) in zip(encoding["input_ids"], encoding["offset_mapping"])]
    labels[0] = -100
    return encoding["input_ids"], labels


# ---------------------------------------------------------------- conversations, as OpenAI's API sends them

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city."},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
# Another tool whose keys come in another order, as a dataset may hold them: each keeps its own order.
TIME_TOOL = {"function": {"parameters": {"properties": {"zone": {"type": "string"}}, "type": "object"},
                          "name": "get_time"}, "type": "function"}


def tool_call(call_id: str, name: str, arguments: dict) -> dict:
    """A tool call as OpenAI sends it: arguments as a JSON string."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def tool_conversation() -> dict:
    """A record with tools: a question answered by a tool call, its result, the answer, then a second round.
    Call ids have 9 characters, as Mistral's template requires."""
    return {"tools": [WEATHER_TOOL, TIME_TOOL], "messages": [
        {"role": "system", "content": "You help with the weather."},
        {"role": "user", "content": "How warm is it in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [tool_call("call00001", "get_weather",
                                                                       {"city": "Paris", "unit": "celsius"})]},
        {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": '{"celsius": 18}'},
        {"role": "assistant", "content": "It is 18 degrees in Paris."},
        {"role": "user", "content": "And the time in Tokyo?"},
        {"role": "assistant", "content": "",
         "tool_calls": [tool_call("call00002", "get_time", {"zone": "Asia/Tokyo"})]},
        {"role": "tool", "tool_call_id": "call00002", "name": "get_time", "content": '{"time": "09:30"}'},
        {"role": "assistant", "content": "It is 09:30 in Tokyo."}]}


def reasoning_conversation() -> dict:
    """Two rounds whose answers carry reasoning, one as reasoning_content and one as a <think> block, and a tool
    call with reasoning in the last round."""
    return {"tools": [WEATHER_TOOL], "messages": [
        {"role": "user", "content": "What is 12 times 3?"},
        {"role": "assistant", "content": "36.", "reasoning_content": "12 times 3 is 36."},
        {"role": "user", "content": "Is it warm in Rome?"},
        {"role": "assistant", "content": "", "reasoning_content": "I should look up the weather.",
         "tool_calls": [tool_call("call00003", "get_weather", {"city": "Rome"})]},
        {"role": "tool", "tool_call_id": "call00003", "name": "get_weather", "content": '{"celsius": 25}'},
        {"role": "assistant", "content": "<think>\n25 degrees is warm.\n</think>\n\nYes, 25 degrees."}]}
