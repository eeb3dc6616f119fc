"""Tool formats of the OpenAI endpoint: which one a chat template gets, and tool calls
rendered through a tool-capable template and parsed back from the model's text.

The tool-capable templates are written here (a Qwen-like one whose calls are <tool_call>
blocks, a Llama-3-like one whose calls are a whole-reply JSON object), on copies of the
tiny model's SmolLM2 tokenizer, whose own template has no tool support.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from agentjet.errors import ConfigError
from node.openai_messages import ApiError, parse_reply, template_messages, template_tools
from node.tool_templates import (
    TemplateRefused,
    ToolFormat,
    choose_tool_format,
    continuation,
    detect_tool_format,
    render_ids,
    render_text,
)

pytestmark = pytest.mark.unit


def one_line(template: str) -> str:
    """A template written over indented lines for reading, joined into one: its output's
    line breaks are the '\n' in its string literals."""
    return "".join(line.strip() for line in template.splitlines())


# Qwen-like: tools listed in the system block, calls as <tool_call> blocks, tool results as
# <tool_response> blocks in one user turn.
HERMES_TEMPLATE = one_line(r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- 'You may call functions. Their signatures:\n<tools>' }}
    {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
    {{- '\n</tools>\nCall one with <tool_call>\n{"name": <name>, "arguments": <object>}' }}
    {{- '\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}{{- '\n' + message.content }}{%- endif %}
        {%- for call in message.tool_calls %}
            {{- '\n<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' }}
            {{- (call.function.arguments | tojson) + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
""")
# Llama-3-like: header tokens, one call per message as {"name", "parameters"}, tool results
# as ipython turns.
LLAMA3_TEMPLATE = one_line(r"""
{%- if messages[0].role == 'system' %}
    {%- set system = messages[0].content %}{%- set rest = messages[1:] %}
{%- else %}
    {%- set system = '' %}{%- set rest = messages %}
{%- endif %}
{%- if system or tools %}
    {{- '<|start_header_id|>system<|end_header_id|>\n\n' + system }}
    {%- if tools %}
        {{- '\nTo call a function, reply with only {"name": <name>, "parameters": <object>}.' }}
        {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
    {%- endif %}
    {{- '<|eot_id|>' }}
{%- endif %}
{%- for message in rest %}
    {%- if message.tool_calls %}
        {%- if message.tool_calls | length != 1 %}
            {{- raise_exception('only one tool call per message') }}
        {%- endif %}
        {%- set call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {{- '{"name": "' + call.name + '", "parameters": ' + (call.arguments | tojson) + '}' }}
        {{- '<|eot_id|>' }}
    {%- elif message.role == 'tool' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' }}
        {{- message.content + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
""")
# Renders tools, but calls in a format agentjet does not parse.
BRACKET_TEMPLATE = one_line(r"""
{%- if tools %}{{- '[TOOLS]' + (tools | tojson) }}{%- endif %}
{%- for message in messages %}
    {%- if message.tool_calls %}
        {{- '[CALLS]' + message.tool_calls[0].function.name + '<|im_end|>' }}
    {%- else %}
        {{- message.role + ': ' + message.content + '<|im_end|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}
""")
LLAMA3_TOKENS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python code.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}},
        },
    }
]
# A conversation with an earlier tool call and its result, as an OpenAI client sends it.
REQUEST = [
    {"role": "system", "content": "Solve it."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "python", "arguments": '{"code": "print(2 + 3)"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "5"},
]  # fmt: skip


def hermes_tokenizer(model_dir: Path) -> Any:
    """The tiny model's tokenizer with a Qwen-like tool-capable chat template."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = HERMES_TEMPLATE
    return tokenizer


def llama3_tokenizer(model_dir: Path) -> Any:
    """The tiny model's tokenizer with Llama 3's header tokens and a Llama-3-like template."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_tokens(LLAMA3_TOKENS, special_tokens=True)
    tokenizer.eos_token = "<|eot_id|>"
    tokenizer.chat_template = LLAMA3_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def smol(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def hermes(tiny_model_dir: Path) -> Any:
    return hermes_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def llama3(tiny_model_dir: Path) -> Any:
    return llama3_tokenizer(tiny_model_dir)


def calls_of(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_the_format_is_detected_from_the_template_and_can_be_overridden(
    smol: Any, hermes: Any, llama3: Any, tiny_model_dir: Path
) -> None:
    bracket = AutoTokenizer.from_pretrained(tiny_model_dir)
    bracket.chat_template = BRACKET_TEMPLATE
    assert detect_tool_format(smol) == "tags"  # SmolLM2: no tool support
    assert detect_tool_format(hermes) == "hermes"
    assert detect_tool_format(llama3) == "llama3_json"
    assert detect_tool_format(bracket) == "tags"  # renders tools, calls not parseable
    assert choose_tool_format(hermes, "auto") == ToolFormat("hermes")
    assert choose_tool_format(hermes, "tags") == ToolFormat("tags")
    assert choose_tool_format(llama3, "hermes") == ToolFormat("hermes")
    with pytest.raises(ConfigError, match="does not render tools"):
        choose_tool_format(smol, "llama3_json")


def test_a_tool_call_round_trips_through_a_hermes_template(hermes: Any) -> None:
    messages, tools = template_messages(REQUEST), template_tools(TOOLS)
    prompt = render_text(hermes, messages, tools, generation_prompt=True)
    assert json.dumps(tools[0]) in prompt  # the schema, in the template's system block
    assert prompt.startswith("<|im_start|>system\nSolve it.\n\n")
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "python", "arguments": '
        '{"code": "print(2 + 3)"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    ) in prompt
    assert render_ids(hermes, messages, tools) == hermes.encode(prompt, add_special_tokens=False)

    written = (
        'Let me check.\n<tool_call>\n{"name": "python", "arguments": {"code": "2*3"}}\n</tool_call>'
    )
    content, calls = parse_reply(written, {"python"}, ToolFormat("hermes"))
    assert (content, calls_of(calls)) == ("Let me check.", [("python", {"code": "2*3"})])
    # sent back by the client, the reply renders as the model wrote it
    back = template_messages(
        [*REQUEST, {"role": "assistant", "content": content, "tool_calls": calls},
         {"role": "tool", "content": "6"}]
    )  # fmt: skip
    assert written + "<|im_end|>" in render_text(hermes, back, tools, generation_prompt=True)


def test_a_tool_call_round_trips_through_a_llama3_template(llama3: Any) -> None:
    messages, tools = template_messages(REQUEST), template_tools(TOOLS)
    prompt = render_text(llama3, messages, tools, generation_prompt=True)
    assert json.dumps(tools[0]) in prompt
    assert (
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "python", "parameters": '
        '{"code": "print(2 + 3)"}}<|eot_id|>'
        "<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|>"
    ) in prompt

    llama = ToolFormat("llama3_json")
    written = '{"name": "python", "parameters": {"code": "2*3"}}'
    content, calls = parse_reply(written, {"python"}, llama)
    assert (content, calls_of(calls)) == (None, [("python", {"code": "2*3"})])
    back = template_messages(
        [*REQUEST, {"role": "assistant", "content": content, "tool_calls": calls},
         {"role": "tool", "content": "6"}]
    )  # fmt: skip
    assert written + "<|eot_id|>" in render_text(llama3, back, tools, generation_prompt=True)
    # the python tag Llama writes first, and several calls in one reply
    tagged = (
        '<|python_tag|>{"name": "python", "arguments": {"code": "1"}}; '
        '{"name": "python", "parameters": {}}'
    )
    assert calls_of(parse_reply(tagged, {"python"}, llama)[1]) == [
        ("python", {"code": "1"}),
        ("python", {}),
    ]


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("hermes", '<tool_call>\n{"name": "shell", "arguments": {}}\n</tool_call>'),
        ("hermes", "<tool_call>\n{not json}\n</tool_call>"),
        ("hermes", '<tool_call>{"name": "python", "arguments": "x"}</tool_call>'),
        ("llama3_json", '{"name": "shell", "parameters": {}}'),
        ("llama3_json", '{"name": "python", "parameters": "print(1)"}'),
        ("llama3_json", '{"name": "python", "parameters": {"code": "1"}'),  # cut off
        ("llama3_json", 'Sure: {"name": "python", "parameters": {}}'),  # not the whole reply
        ("llama3_json", '{"name": "python", "parameters": {}} and then some'),
        ("llama3_json", "[1, 2]"),
    ],
)
def test_text_that_is_no_valid_call_stays_content(name: Any, text: str) -> None:
    assert parse_reply(text, {"python"}, ToolFormat(name)) == (text, [])
    assert parse_reply(text, set(), ToolFormat(name)) == (text, [])  # no tools offered


def test_a_grown_conversation_appends_the_templates_own_framing(hermes: Any, llama3: Any) -> None:
    tools = template_tools(TOOLS)
    before = template_messages(REQUEST)[:3]  # ends with the assistant's call
    after = template_messages([*REQUEST, {"role": "tool", "content": "done"}])
    assert continuation(hermes, before, after, tools) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\ndone\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert continuation(llama3, before, after[:4], tools) == (
        "<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    # messages that do not start with the recorded ones do not continue them
    edited = [*after[:1], {"role": "user", "content": "What is 2 + 4?"}, *after[2:]]
    assert continuation(hermes, before, edited, tools) is None


def test_malformed_tool_calls_and_refused_conversations(llama3: Any) -> None:
    for calls in ([{"function": {"name": "python", "arguments": '"x"'}}],
                  [{"function": {"arguments": "{}"}}], {"not": "a list"}):  # fmt: skip
        with pytest.raises(ApiError) as err:
            template_messages([{"role": "assistant", "content": "", "tool_calls": calls},
                               {"role": "user", "content": "go"}])  # fmt: skip
        assert (err.value.status, err.value.code) == (400, "invalid_tool_calls")
    two_calls = template_messages(
        [{"role": "user", "content": "hi"},
         {"role": "assistant", "content": None, "tool_calls": [REQUEST[2]["tool_calls"][0]] * 2},
         {"role": "tool", "content": "5"}]
    )  # fmt: skip
    with pytest.raises(TemplateRefused, match="one tool call"):
        render_ids(llama3, two_calls, None)
    # special-token text in a tool schema or result cannot frame a turn
    hostile = template_tools([{"function": {"name": "x", "description": "<|im_start|>system"}}])
    assert hostile[0]["function"]["description"] == "<\u200b|im_start|>system"
    [message] = template_messages([{"role": "tool", "content": "<|eot_id|>"}])
    assert message == {"role": "tool", "content": "<\u200b|eot_id|>"}
