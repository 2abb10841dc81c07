"""Tools on /v1/chat/completions: into the prompt, tool_choice into a grammar, text into calls.

    tool_choice      prompt             output constrained to                parsed into calls
    "none"           tools described    nothing                              no
    "auto"           tools described    nothing (the model decides)          yes (the parser)
    "required"       tools described    one or more calls (parallel_tool_calls: more than one)
    {"function": f}  tools described    exactly one call of f

The calls are written in the tool-call parser's format (--tool-call-parser, hermes unless set):
    hermes       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
    llama3_json  {"name": "f", "parameters": {...}}
so "required" and a named function are parsed by the same parser as "auto", streamed or not.
A chat template that takes `tools` gets them as is; any other gets a system block describing
them in that format (TOOL_SYSTEM_PROMPT), and earlier tool calls and results are written into
the turns as the same text (docs/structured.md).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tierserve.engine.api import StructuredOutput
from tierserve.server.errors import bad_request
from tierserve.server.structured import Constraint
from tierserve.server.tool_parsers import ToolParser, tool_parser

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_EMPTY_PARAMS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class CallFormat:
    """How one tool call is written in a parser's format (begin + arguments + end)."""

    begin: str
    """With {name} for the function's name."""
    end: str
    trigger: str
    """Where a call starts, whatever the name."""
    separator: str
    """Between parallel calls."""


FORMATS = {
    "hermes": CallFormat('<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>",
                         "<tool_call>", "\n"),
    "llama3_json": CallFormat('{{"name": "{name}", "parameters": ', "}", '{"name": ', "; "),
}

TOOL_SYSTEM_PROMPT = (
    "You are a function calling AI model. You may call one or more functions to assist with "
    "the user query. The functions you may call are listed here, one JSON signature a line:\n"
    "{signatures}\n"
    "To call a function, reply with exactly this, once per call, and nothing else:\n{example}")


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools and tool_choice mean for its prompt and its output."""

    tools: list[dict]
    """The request's tools, checked (OpenAI's shape)."""
    choice: str
    """none, auto, required or function."""
    parser: ToolParser | None
    """Reads the calls out of the output (None: tool_choice none, plain text)."""
    constraint: Constraint | None
    """The grammar that forces the calls (required and a named function)."""
    fmt: CallFormat

    def schema_constraints(self) -> list[Constraint]:
        """Each tool's parameters as a JSON schema, so one xgrammar refuses is a 400 whatever
        tool_choice is."""
        return [Constraint(StructuredOutput.json(_params(t), f"tools[{i}].function.parameters"),
                           f"tools[{i}].function.parameters") for i, t in enumerate(self.tools)]


def plan_tools(tools: list[dict] | None, tool_choice: Any, parallel: bool | None,
               auto_enabled: bool, parser_name: str | None) -> ToolPlan | None:
    """The request's tool plan; None without tools. Every refusal is a 400 naming the field."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    _check_tools(tools)
    names = [t["function"]["name"] for t in tools]
    choice, named = _choice(tool_choice, names)
    if choice == "auto" and not auto_enabled:
        raise bad_request('tool_choice "auto" needs a server started with '
                          "--enable-auto-tool-choice (and --tool-call-parser); send "
                          '"required", a named function or "none"', "tool_choice")
    name = parser_name or "hermes"
    fmt = FORMATS[name]
    constraint = None
    if choice in ("required", "function"):
        chosen = [t for t in tools if t["function"]["name"] == named] if named else tools
        tag = _structural_tag(chosen, fmt, choice == "function" or parallel is False)
        constraint = Constraint(StructuredOutput.structural_tag(tag, "tools"), "tools")
    return ToolPlan(tools, choice, None if choice == "none" else tool_parser(name), constraint,
                    fmt)


def _check_tools(tools: list[dict]) -> None:
    seen = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" \
                or not isinstance(fn, dict):
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                              "{...}}", f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -, "
                              f"got {name!r}", f"tools[{i}].function.name")
        if name in seen:
            raise bad_request(f"tools[{i}].function.name {name!r} is given twice",
                              f"tools[{i}].function.name")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object",
                              f"tools[{i}].function.parameters")


def _choice(tool_choice: Any, names: list[str]) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise bad_request('tool_choice must be "none", "auto", "required" or {"type": '
                              f'"function", "function": {{"name": ...}}}}, got {tool_choice!r}',
                              "tool_choice")
        return tool_choice, None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad_request('tool_choice must name a function: {"type": "function", "function": '
                          '{"name": ...}}', "tool_choice")
    if name not in names:
        raise bad_request(f"tool_choice names {name!r}, which is not in tools ({names})",
                          "tool_choice")
    return "function", name


def _params(tool: dict) -> dict:
    return tool["function"].get("parameters") or _EMPTY_PARAMS


def _structural_tag(tools: list[dict], fmt: CallFormat, one: bool) -> dict:
    """xgrammar's structural tag for calls in `fmt`: exactly one (a named function, or
    parallel_tool_calls false), else one or more. Arguments get single spaces at most: a small
    model at temperature 1 can otherwise write whitespace until max_tokens."""
    tags = [{"type": "tag", "begin": fmt.begin.format(name=t["function"]["name"]),
             "content": {"type": "json_schema", "json_schema": _params(t),
                         "max_whitespace_cnt": 1}, "end": fmt.end}
            for t in tools]
    if len(tags) == 1 and one:
        return {"type": "structural_tag", "format": tags[0]}
    return {"type": "structural_tag", "format": {
        "type": "tags_with_separator", "tags": tags, "separator": fmt.separator,
        "at_least_one": True, "stop_after_first": one}}


# ---- the prompt ------------------------------------------------------------------------------


def template_messages(plan: ToolPlan | None, messages: list[dict],
                      takes_tools: bool) -> tuple[list[dict], dict]:
    """The turns and extra template variables: a template that takes tools gets `tools` and the
    turns as OpenAI sends them (arguments as objects, as HF templates expect); another gets a
    system block and the calls and results written into the turns' text."""
    if takes_tools:
        return [_with_argument_objects(m) for m in messages], (
            {"tools": plan.tools} if plan else {})
    fmt = plan.fmt if plan else FORMATS["hermes"]
    out = [_as_text(m, fmt) for m in messages]
    if plan is None:
        return out, {}
    block = TOOL_SYSTEM_PROMPT.format(
        signatures="\n".join(json.dumps(t["function"], ensure_ascii=False) for t in plan.tools),
        example=fmt.begin.format(name="<function name>") + "<arguments object>" + fmt.end)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + block}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out, {}


def _with_argument_objects(m: dict) -> dict:
    if not m.get("tool_calls"):
        return m
    calls = []
    for c in m["tool_calls"]:
        fn = dict(c["function"])
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            pass  # a template that prints arguments gets the text
        calls.append({**c, "function": fn})
    return {**m, "tool_calls": calls}


def _as_text(m: dict, fmt: CallFormat) -> dict:
    if m["role"] == "tool":
        return {"role": "user",
                "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
    if not m.get("tool_calls"):
        return {"role": m["role"], "content": m["content"]}
    calls = fmt.separator.join(fmt.begin.format(name=c["function"]["name"])
                               + c["function"]["arguments"] + fmt.end for c in m["tool_calls"])
    text = (m["content"] + "\n" if m["content"] else "") + calls
    return {"role": m["role"], "content": text}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
