"""Function calling in the Hermes format that Qwen2.5's and Hermes' chat templates teach their models:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The chat template renders the request's tools into the prompt; here the answer's calls are parsed out of
its text (whole, or piece by piece while streaming), and `tool_choice` "required" or a named function is
enforced by a grammar of that format (structured output): every call names one of the tools, with
arguments that validate against its parameters' schema.

    calls = ToolCallText()            # one per choice
    content, found = calls.feed(piece)  # text outside calls (held back while a tag may be starting), calls
    rest = calls.finish()              # at the end: an unterminated call comes back as text
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from specdec.engine.structured_output import JSON_OPTIONS, StructuredOutput

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it
    id: str

    def as_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def parse_call(body: str) -> ToolCall | None:
    """A call's JSON ({"name": ..., "arguments": {...}}), or None when it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ToolCall(value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False),
                    f"call_{uuid.uuid4().hex[:24]}")


class ToolCallText:
    """One answer's text split into content and tool calls as it arrives."""

    def __init__(self):
        self.pending = ""  # text not yet given out: a call being written, or what may start one
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.pending += text
        content, found = [], []
        while True:
            start = self.pending.find(OPEN)
            if start < 0:
                keep = partial_tag_length(self.pending, OPEN)  # "<tool" may be the start of a call: hold it back
                content.append(self.pending[:len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                break
            end = self.pending.find(CLOSE, start)
            if end < 0:
                content.append(self.pending[:start])
                self.pending = self.pending[start:]
                break
            body = self.pending[start + len(OPEN):end]
            call = parse_call(body.strip())
            content.append(self.pending[:start] if call is not None else self.pending[:end + len(CLOSE)])
            if call is not None:
                found.append(call)
            self.pending = self.pending[end + len(CLOSE):]
        self.calls += found
        return "".join(content), found

    def finish(self) -> str:
        """The rest: text held back, and a call that never closed, come back as content."""
        rest, self.pending = self.pending, ""
        return rest


def partial_tag_length(text: str, tag: str) -> int:
    """How many characters at the end of `text` are the start of `tag` (text to hold back while streaming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole answer's content (None when only calls remain) and its calls."""
    parser = ToolCallText()
    content, calls = parser.feed(text)
    content = (content + parser.finish()).strip()
    return content or None, calls


def forced_calls(tools: list[dict], name: str | None, parallel: bool) -> StructuredOutput:
    """The grammar of an answer that is nothing but calls: of the function `name`, or (None) of any of `tools`,
    one call or (parallel) one or more. Each call's arguments follow its function's parameters."""
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    call = {"anyOf": [{"type": "object", "properties": {
        "name": {"const": f["name"]},
        "arguments": f.get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"], "additionalProperties": False} for f in functions],
        "x-guidance": JSON_OPTIONS}
    lark = (f'start: call{"+" if parallel else ""}\n'
            f'call: {json.dumps(OPEN + chr(10))} %json {json.dumps(call)} {json.dumps(chr(10) + CLOSE + chr(10))}\n')
    return StructuredOutput(grammar=lark)
