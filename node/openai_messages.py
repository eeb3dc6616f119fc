"""What the OpenAI endpoint (node/openai_api.py) reads from a request, checked, and what it
makes of the model's reply: chat messages in the form the model's chat template takes,
tools, an evaluation request's sampling settings; `ApiError` for anything malformed.

    request body ──json_body──▶ messages ──normalize_messages ("tags") / template_messages──▶
        the chat template;  tools ──template_tools / TOOL_PROMPT──▶ the prompt
    completion text ──parse_reply──▶ content + OpenAI tool_calls
    a request's copy of a reply ──reply_text, same_text──▶ matched to the recorded one

**Tools.** The model's chat template (node/tool_templates.py, chosen by the server) decides
the form. A template that renders tools (Qwen, Llama 3) gets the request's `tools`, earlier
assistant `tool_calls` (arguments as JSON objects) and `tool` messages as structured data
and renders them itself, and the model's calls are parsed in that template's format:
`<tool_call>` blocks ("hermes") or a whole-reply `{"name", "parameters"}` object
("llama3_json"). A template without tool support (SmolLM2) gets the "tags" convention: the
tools are described in the system message, the model calls one by writing
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, earlier calls are rendered back
as such blocks, and `tool` messages go to the model as user turns ("Tool result: ...").
Either way calls come back as OpenAI `tool_calls` (finish_reason "tool_calls"); text that
is not a valid call of an offered tool stays content.

Every check raises `ApiError`, which the server answers as an OpenAI-style error
(`{"error": {"message", "type", "code"}}`) with a 4xx status.
"""

from __future__ import annotations

import json
import re
from typing import Any

from aiohttp import web

from agentjet.episode import SamplingParams
from node.tool_templates import TAGS, ToolFormat

# Most messages per request and characters per message.
MAX_MESSAGES = 512
MAX_MESSAGE_CHARS = 200_000
TOOL_PROMPT = (
    "You can call tools. To call one, reply with "
    '<tool_call>{{"name": "<tool name>", "arguments": {{...}}}}</tool_call>. '
    "Tools:\n{tools}"
)
# Special-token text in message content is defused so it cannot frame a fake turn.
_SPECIAL = re.compile(r"<\|")


class ApiError(Exception):
    """An error the client caused or may see: becomes an OpenAI-style error response."""

    def __init__(self, status: int, message: str, code: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.code = code
        self.kind = kind

    def response(self) -> web.Response:
        body = {
            "error": {"message": str(self), "type": self.kind, "param": None, "code": self.code}
        }
        return web.json_response(body, status=self.status)


# ── chat messages ─────────────────────────────────────────────────────────────────────


def normalize_messages(messages: Any, tools: list[dict[str, Any]] | None) -> list[dict[str, str]]:
    """Request messages as a template without tool support takes them (the "tags"
    format): role and text content; tool results become user turns, consecutive user turns
    one; tools described in the system message. ApiError for anything malformed."""
    out: list[dict[str, str]] = []
    for i, message in enumerate(_message_list(messages)):
        role, content = _role_and_text(message, i)
        if role == "assistant":
            content = assistant_text(message, i)
        elif role == "tool":
            role, content = "user", f"Tool result: {content}"
        content = _SPECIAL.sub("<\u200b|", content) if role != "assistant" else content
        if out and role == "user" and out[-1]["role"] == "user":
            out[-1]["content"] += "\n\n" + content
        else:
            out.append({"role": role, "content": content})
    _check_last(out)
    if tools:
        described = TOOL_PROMPT.format(
            tools="\n".join(json.dumps(t) for t in tool_functions(tools))
        )
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + described}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out


def template_messages(messages: Any) -> list[dict[str, Any]]:
    """Request messages as a template that renders tools takes them: text content,
    assistant `tool_calls` with their arguments as JSON objects, tool results as `tool`
    messages. ApiError for anything malformed."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(_message_list(messages)):
        role, content = _role_and_text(message, i)
        if role != "assistant":
            out.append({"role": role, "content": _SPECIAL.sub("<\u200b|", content)})
            continue
        assistant: dict[str, Any] = {"role": "assistant", "content": content}
        if calls := [_parsed_call(c, i) for c in _tool_calls(message, i)]:
            if not all(isinstance(arguments, dict) for _, arguments in calls):
                raise ApiError(400, f"messages[{i}].tool_calls: arguments must be JSON objects",
                               "invalid_tool_calls")  # fmt: skip
            assistant["tool_calls"] = [
                {"type": "function", "function": {"name": name, "arguments": arguments}}
                for name, arguments in calls
            ]
        out.append(assistant)
    _check_last(out)
    return out


def template_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's tools as a chat template takes them (JSON schemas), special-token
    text defused: the template puts them in the prompt as they are."""
    return [{"type": "function", "function": _defused(f)} for f in tool_functions(tools)]


def parse_reply(
    text: str, tool_names: set[str], tool_format: ToolFormat = TAGS
) -> tuple[str | None, list[dict[str, Any]]]:
    """A completion's text as an OpenAI assistant message: content and tool_calls in the
    model's tool format. Text that is not a valid call of a known tool stays content; with
    no tools offered the text is all content, as written."""
    return tool_format.parse(text, tool_names) if tool_names else (text, [])


def assistant_text(message: dict[str, Any], i: int) -> str:
    """An assistant message as the model wrote it: content, then its tool calls."""
    calls = _tool_calls(message, i)
    return _text(message.get("content"), i) + "".join(
        _call_block(*_parsed_call(c, i)) for c in calls
    )


def reply_text(message: dict[str, Any]) -> str:
    """A normalized assistant message (either format) as `assistant_text` writes it: what a
    request's copy of a reply is compared to the recorded reply by."""
    calls = message.get("tool_calls", [])
    return message["content"] + "".join(
        _call_block(c["function"]["name"], c["function"]["arguments"]) for c in calls
    )


def same_text(a: str, b: str) -> bool:
    """Equal up to whitespace: the fallback comparison for re-formatted history."""
    return a.split() == b.split()


def _message_list(messages: Any) -> list[Any]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "invalid_messages")
    if len(messages) > MAX_MESSAGES:
        raise ApiError(400, f"at most {MAX_MESSAGES} messages", "too_many_messages")
    return messages


def _role_and_text(message: Any, i: int) -> tuple[str, str]:
    """A message's role (developer is system) and text content, checked."""
    if not isinstance(message, dict):
        raise ApiError(400, f"messages[{i}] must be an object", "invalid_messages")
    role = message.get("role")
    content = _text(message.get("content"), i)
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise ApiError(400, f"messages[{i}].role {role!r} is not supported", "invalid_role")
    return role, content


def _check_last(messages: list[dict[str, Any]]) -> None:
    if messages[-1]["role"] == "assistant":
        raise ApiError(400, "the last message must be from the user or a tool", "invalid_messages")


def _text(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise ApiError(400, f"messages[{i}]: only text content parts", "invalid_content")
            parts.append(str(part.get("text", "")))
        text = "".join(parts)
    else:
        raise ApiError(400, f"messages[{i}].content must be text", "invalid_content")
    if len(text) > MAX_MESSAGE_CHARS:
        raise ApiError(
            400, f"messages[{i}] is longer than {MAX_MESSAGE_CHARS} characters", "too_long"
        )
    return text


def _tool_calls(message: dict[str, Any], i: int) -> list[Any]:
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ApiError(400, f"messages[{i}].tool_calls must be a list", "invalid_tool_calls")
    return calls


def _parsed_call(call: Any, i: int) -> tuple[str, Any]:
    """A request's tool call as (name, arguments parsed from their JSON text)."""
    try:
        function = call["function"]
        return str(function["name"]), json.loads(function.get("arguments") or "{}")
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError):
        raise ApiError(
            400, f"messages[{i}].tool_calls is malformed", "invalid_tool_calls"
        ) from None


def _call_block(name: str, arguments: Any) -> str:
    """A tool call as the tags convention writes it (arguments as canonical JSON)."""
    body = {"name": name, "arguments": arguments}
    return f"<tool_call>{json.dumps(body, sort_keys=True)}</tool_call>"


def _defused(value: Any) -> Any:
    """A JSON value with special-token text defused in every string."""
    if isinstance(value, str):
        return _SPECIAL.sub("<\u200b|", value)
    if isinstance(value, dict):
        return {_defused(k): _defused(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_defused(v) for v in value]
    return value


def tool_functions(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's function tools as {name, description, parameters}."""
    try:
        return [
            {
                "name": str(t["function"]["name"]),
                "description": str(t["function"].get("description", "")),
                "parameters": t["function"].get("parameters", {}),
            }
            for t in tools
            if t.get("type", "function") == "function"
        ]
    except (KeyError, TypeError, AttributeError):
        raise ApiError(400, "tools must be a list of function tools", "invalid_tools") from None


# ── request bodies ────────────────────────────────────────────────────────────────────


async def json_body(request: web.Request, *, required: bool = True) -> dict[str, Any]:
    """The request's body, a JSON object (an empty one is {} unless `required`)."""
    raw = await request.read()
    if not raw and not required:
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "the body is not valid JSON", "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", "invalid_json")
    return body


def client_params(body: dict[str, Any], default: SamplingParams) -> SamplingParams:
    """An evaluation request's own sampling settings (checked), else the node's."""
    temperature = body.get("temperature", default.temperature)
    top_p = body.get("top_p", default.top_p)
    max_tokens = (
        body.get("max_completion_tokens") or body.get("max_tokens") or default.max_new_tokens
    )
    for name, value, low, high in (
        ("temperature", temperature, 0.0, 2.0),
        ("top_p", top_p, 0.0, 1.0),
        ("max_tokens", max_tokens, 1, 8192),
    ):
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not low <= value <= high
        ):
            raise ApiError(400, f"{name} must be a number in [{low}, {high}]", f"invalid_{name}")
    if temperature == 0:
        return SamplingParams(max_new_tokens=int(max_tokens), greedy=True)
    return SamplingParams(temperature=float(temperature), top_p=float(top_p) or 1.0,
                          max_new_tokens=int(max_tokens))  # fmt: skip
