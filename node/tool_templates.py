"""How a model's chat template takes tools, and how that model writes its tool calls.

    request tools, tool calls, tool results ──▶ ToolFormat ──▶ prompt (chat template)
    completion text ──ToolFormat.parse──▶ content + OpenAI tool_calls

Three formats (`rollout.tool_format`; "auto" detects one from the template):

    "tags"         the template has no tool support (SmolLM2): the OpenAI endpoint describes
                   the tools in the system message, the model writes
                   <tool_call>{"name": ..., "arguments": {...}}</tool_call>, earlier calls are
                   rendered back as such blocks and tool results as user turns
                   (node/openai_messages.py `normalize_messages`)
    "hermes"       the template renders `tools=`, assistant `tool_calls` and `tool` messages
                   itself, and a call is <tool_call>\\n{"name", "arguments"}\\n</tool_call>
                   (Qwen2.5, Qwen3, Hermes)
    "llama3_json"  the template renders them itself, and a call is the whole reply:
                   {"name": ..., "parameters": {...}}, maybe after <|python_tag|> (Llama 3.1-3.3)

Detection renders probe conversations through the template: a template that leaves a
probe tool's name out of the prompt has no tool support ("tags"); one that renders the
probe call inside <tool_call> is "hermes", as a {"name", "parameters"} object "llama3_json".
A template that renders tools in any other way (Mistral's [TOOL_CALLS], pythonic calls)
gets "tags" too, with a warning: agentjet would not parse its calls.

The endpoint renders its prompts through `render_ids` / `render_text` here; a
conversation the template refuses (its raise_exception: Llama's one call per
message) raises TemplateRefused, which the endpoint answers with a 400.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import jinja2

from agentjet.errors import ConfigError

log = logging.getLogger(__name__)

FormatName = Literal["tags", "hermes", "llama3_json"]
Setting = Literal["auto", "tags", "hermes", "llama3_json"]

# A call block of the tags and Hermes formats; the JSON inside may span lines.
_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
# Llama 3 starts a call with this special token; decoding usually drops it already.
_PYTHON_TAG = "<|python_tag|>"
# Between two Llama 3 JSON calls of one reply.
_CALL_SEPARATORS = "; \t\r\n"

_PROBE_NAME = "agentjet_probe_tool"
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": _PROBE_NAME,
        "description": "A probe.",
        "parameters": {"type": "object", "properties": {"probe_arg": {"type": "string"}}},
    },
}
_PROBE_QUESTION = {"role": "user", "content": "question"}
_PROBE_CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {"type": "function", "function": {"name": _PROBE_NAME, "arguments": {"probe_arg": "x"}}}
    ],
}
_HERMES_CALL = re.compile(r'<tool_call>\s*\{\s*"name":\s*"' + _PROBE_NAME + '"')
_LLAMA3_CALL = re.compile(r'\{\s*"name":\s*"' + _PROBE_NAME + r'",\s*"parameters":')


class TemplateRefused(ValueError):
    """The chat template raised on a conversation (its own check, or data it cannot render)."""


@dataclass(frozen=True)
class ToolFormat:
    """One of the formats of the module docstring."""

    name: FormatName

    @property
    def in_template(self) -> bool:
        """Whether tools, calls and results go to the chat template as structured data."""
        return self.name != "tags"

    def parse(self, text: str, tool_names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
        """A completion's text as an OpenAI assistant message: content and tool_calls. Text
        that is not a valid call of a known tool stays content."""
        if self.name == "llama3_json":
            return parse_json_calls(text, tool_names)
        return parse_call_blocks(text, tool_names)


TAGS = ToolFormat("tags")


def choose_tool_format(tokenizer: Any, setting: Setting) -> ToolFormat:
    """The format for `setting` (rollout.tool_format). ConfigError when a template format is
    forced on a template that does not render tools."""
    if setting == "tags":
        return TAGS
    if setting == "auto":
        return ToolFormat(detect_tool_format(tokenizer))
    if not renders_tools(tokenizer):
        raise ConfigError(
            f"rollout.tool_format = {setting!r}: this model's chat template does not render "
            'tools; use "auto" or "tags"'
        )
    return ToolFormat(setting)


def detect_tool_format(tokenizer: Any) -> FormatName:
    """The format the tokenizer's chat template uses (module docstring)."""
    if not renders_tools(tokenizer):
        return "tags"
    try:
        asked = render_text(tokenizer, [_PROBE_QUESTION], [_PROBE_TOOL], generation_prompt=True)
        called = render_text(
            tokenizer, [_PROBE_QUESTION, _PROBE_CALL], [_PROBE_TOOL], generation_prompt=False
        )
    except TemplateRefused:
        return "tags"
    # The assistant turn alone, so the tool list in the system block cannot match.
    turn = called.removeprefix(asked) if called.startswith(asked) else called
    if _HERMES_CALL.search(turn):
        return "hermes"
    if _LLAMA3_CALL.search(turn):
        return "llama3_json"
    log.warning(
        "the chat template renders tools, but its tool calls are in a format agentjet does "
        'not parse: using rollout.tool_format = "tags" (tools described in the system message)'
    )
    return "tags"


def renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template puts the request's tools into the prompt."""
    try:
        text = render_text(tokenizer, [_PROBE_QUESTION], [_PROBE_TOOL], generation_prompt=True)
    except TemplateRefused:
        return False
    return _PROBE_NAME in text


# ── rendering ─────────────────────────────────────────────────────────────────────────


def render_ids(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[int]:
    """Prompt ids of `messages` up to the assistant header. TemplateRefused if the template
    raises."""
    try:
        ids = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    except jinja2.TemplateError as e:
        raise TemplateRefused(str(e)) from None
    if isinstance(ids, Mapping) or hasattr(ids, "keys"):  # a BatchEncoding in some versions
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def render_text(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    generation_prompt: bool,
) -> str:
    """`messages` rendered by the chat template as text. TemplateRefused if it raises."""
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False
        )
    except jinja2.TemplateError as e:
        raise TemplateRefused(str(e)) from None
    return str(text)


def continuation(
    tokenizer: Any,
    before: list[dict[str, Any]],
    after: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
) -> str | None:
    """The text the template renders between the end of `before`'s last (assistant) turn
    and the assistant header that follows `after` (`before` plus new messages): what a
    conversation that grows token-in/token-out appends to the ids the model sampled.

    None when the template does not render `after` as `before` extended: it rewrites
    earlier turns, does not end the assistant turn with the eos token, or refuses a
    conversation that ends with the assistant. TemplateRefused if it refuses `after`."""
    end_of_turn = tokenizer.eos_token
    try:
        head = render_text(tokenizer, before, tools, generation_prompt=False)
    except TemplateRefused:
        return None
    whole = render_text(tokenizer, after, tools, generation_prompt=True)
    end = head.rfind(end_of_turn) if end_of_turn else -1
    if end < 0:
        return None
    cut = end + len(end_of_turn)
    if head[cut:].strip() or not whole.startswith(head[:cut]):
        return None
    return whole[cut:]


# ── parsing ───────────────────────────────────────────────────────────────────────────


def parse_call_blocks(text: str, tool_names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """The tags and Hermes formats: <tool_call>{json}</tool_call> blocks anywhere in the
    text become calls; blocks that are not valid calls of a known tool stay in the content."""
    calls: list[dict[str, Any]] = []

    def take(match: re.Match[str]) -> str:
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            return match.group(0)
        made = _openai_call(call, tool_names, "arguments")
        if made is None:
            return match.group(0)
        calls.append(made)
        return ""

    content = _TOOL_CALL.sub(take, text).strip() if tool_names else text
    return (content or None) if calls else content, calls


def parse_json_calls(text: str, tool_names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """The Llama 3 format: the whole reply is one or more {"name", "parameters"} objects
    (separated by ";" or whitespace). Anything else, or any object that is not a valid call
    of a known tool, leaves the whole text as content."""
    body = text.strip().removeprefix(_PYTHON_TAG).lstrip()
    if not tool_names or not body.startswith("{"):
        return text, []
    decoder = json.JSONDecoder()
    calls: list[dict[str, Any]] = []
    at = 0
    while at < len(body):
        try:
            call, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return text, []
        key = "parameters" if isinstance(call, dict) and "parameters" in call else "arguments"
        made = _openai_call(call, tool_names, key)
        if made is None:
            return text, []
        calls.append(made)
        at = len(body) - len(body[at:].lstrip(_CALL_SEPARATORS))
    return None, calls


def _openai_call(call: Any, tool_names: set[str], key: str) -> dict[str, Any] | None:
    """An OpenAI tool call from a parsed {"name", key: {...}}, or None if it is not a valid
    call of a known tool."""
    if not isinstance(call, dict):
        return None
    name, arguments = call.get("name"), call.get(key, {})
    if name not in tool_names or not isinstance(arguments, dict):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }
