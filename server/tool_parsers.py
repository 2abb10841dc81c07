"""Tool calls out of a model's raw text, like vLLM's `--tool-call-parser hermes|llama3_json`:
`parse` for a whole text, `streamer()` for the pieces of a text still being generated.

    hermes       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>, any number, with
                 text around them. A call ends at the first </tool_call> (or at the end of the
                 text: cut by max_tokens); its JSON must parse or its raw text is content.
    llama3_json  [<|python_tag|>]{"name": "f", "parameters": {...}}; {...} -- the text (after
                 whitespace and the tag) must start with `{`, or it is all content. Calls follow
                 each other, separated by `;` and whitespace; from the first thing that is not a
                 complete, valid call object, the rest of the text is content.

A call's arguments are the raw JSON text of its arguments object as the model wrote it (a JSON
string instead of an object: that string's value; none given: "{}"). Keys: first one wins.

What a stream guarantees, for any split of a text into pieces (`p = parse(text)`):
  * the content it sends, joined, equals `p.content or ""` exactly (parse strips the content);
  * `stream.calls == p.calls`;
  * per index, the name delta plus the joined argument fragments equal p's call of that rank,
    provided every call whose name the stream already sent turns out valid. A call that breaks
    after its name went out (JSON invalid, or cut by max_tokens) cannot be taken back: its index
    stays used, holding a partial call, it is not in `calls`, and its raw text is sent as content
    once the break is known (so the content guarantee holds regardless).
Held back while undecided: a tail that may begin a <tool_call> (or <|python_tag|>), trailing
whitespace, and everything of a call whose name does not come first (sent whole when complete)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """JSON text of the arguments object, exactly as the model wrote it."""


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    """Which call of the message (0, 1, ...)."""
    name: str | None
    """Set on the first delta of a call only."""
    arguments: str
    """A fragment of the arguments' JSON text."""


@dataclass(frozen=True)
class Parsed:
    content: str | None
    """Text outside the calls, stripped; None if nothing but whitespace."""
    calls: list[ToolCall]


class ToolStream(Protocol):
    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """A new piece of generated text -> (content to send now, tool-call deltas to send now)."""

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """End of generation: whatever was held back (text that turned out not to be a call)."""

    @property
    def calls(self) -> list[ToolCall]:
        """The calls completed so far."""


class ToolParser(Protocol):
    name: str

    def parse(self, text: str) -> Parsed: ...
    def streamer(self) -> ToolStream: ...


_WS = r"[ \t\n\r]*"
_HEAD = re.compile(rf'{_WS}\{{{_WS}"name"{_WS}:{_WS}"((?:[^"\\]|\\.)*)"{_WS}[,}}]', re.DOTALL)
"""A call object that starts with its name, and goes on as JSON would: the name can go out."""


def _skip(text: str, i: int, chars: str = " \t\n\r") -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def _partial(text: str, tag: str) -> int:
    """Length of the longest tail of text that may still grow into `tag`: hold it back."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class _Scan:
    """Where a JSON object that starts at `pos` ends, over a text that may still grow. Only
    strings, escapes and bracket depth are tracked (json.loads checks the rest)."""

    def __init__(self, pos: int):
        self.pos, self.depth, self.in_str, self.esc = pos, 0, False, False
        self.end: int | None = None

    def run(self, text: str, stop: int | None = None) -> int | None:
        i, stop = self.pos, len(text) if stop is None else stop
        depth, in_str, esc = self.depth, self.in_str, self.esc
        while i < stop and self.end is None:
            ch = text[i]
            i += 1
            if in_str:
                if esc:
                    esc = False
                elif ch == "\\":
                    esc = True
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    self.end = i
        self.pos, self.depth, self.in_str, self.esc = i, depth, in_str, esc
        return self.end


def _members(text: str) -> dict[str, str]:
    """Key -> raw value text of a JSON object known to be valid; the first of a repeated key."""
    dec, out = json.JSONDecoder(), {}
    i = _skip(text, _skip(text, 0) + 1)
    while i < len(text) and text[i] == '"':
        key, i = json.decoder.scanstring(text, i + 1)
        i = _skip(text, _skip(text, i) + 1)
        _, end = dec.raw_decode(text, i)
        out.setdefault(key, text[i:end])
        i = _skip(text, _skip(text, end) + 1)  # past the ',' (or the closing '}': then done)
    return out


def _call(text: str, keys: tuple[str, ...]) -> ToolCall | None:
    """The call a JSON text holds, or None: not JSON, not an object, no string name, or
    arguments that are neither an object nor a string."""
    try:
        if not isinstance(json.loads(text), dict):
            return None
    except (ValueError, RecursionError):
        return None
    members = _members(text)
    name = json.loads(members.get("name", "null"))
    raw = next((v for k, v in members.items() if k in keys), "{}")
    args = json.loads(raw)
    if not isinstance(name, str) or not isinstance(args, (dict, str)):
        return None
    return ToolCall(name, raw if isinstance(args, dict) else args)


class _CallStream:
    """One call while its JSON arrives: its name once whole (if it comes first), then the
    arguments object's text as far as it goes; `complete` sends whatever that left out."""

    def __init__(self, index: int, args_re: re.Pattern[str]):
        self.index, self._args_re = index, args_re
        self.named = False
        self._after, self._upto, self._sent = 0, 0, []
        self._scan: _Scan | None = None

    def advance(self, text: str, start: int, stop: int) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        if not self.named:
            m = _HEAD.match(text, start, stop)
            try:
                name = json.loads(f'"{m.group(1)}"') if m else None
            except ValueError:  # a bad escape: the call is invalid, complete() says so
                name = None
            if m is None or name is None:
                return out
            self.named, self._after = True, m.end() - 1
            out.append(ToolCallDelta(self.index, name, ""))
        if self._scan is None:
            if not (m := self._args_re.match(text, self._after, stop)):
                return out
            self._upto = m.end() - 1
            self._scan = _Scan(self._upto)
        end = self._scan.run(text, stop)
        upto = stop if end is None else end
        if upto > self._upto:
            self._sent.append(text[self._upto:upto])
            self._upto = upto
            out.append(ToolCallDelta(self.index, None, self._sent[-1]))
        return out

    def complete(self, call: ToolCall | None) -> list[ToolCallDelta]:
        if call is None:
            return []
        out = [] if self.named else [ToolCallDelta(self.index, call.name, "")]
        sent = "".join(self._sent)
        if call.arguments.startswith(sent) and len(call.arguments) > len(sent):
            out.append(ToolCallDelta(self.index, None, call.arguments[len(sent):]))
        return out


class _Stream:
    """What both streams share: the finished calls, the next index, content to send."""

    def __init__(self, args_key: str):
        self._args_re = re.compile(rf'{_WS},{_WS}"(?:{args_key})"{_WS}:{_WS}\{{')
        self._calls, self._next, self._started, self._held = [], 0, False, ""
        self._buf, self._out, self._deltas = "", [], []
        self._cs = _CallStream(0, self._args_re)

    @property
    def calls(self) -> list[ToolCall]:
        return list(self._calls)

    def _end_call(self, call: ToolCall | None, raw: str) -> None:
        """The current call is decided: valid, or its raw text is content."""
        self._deltas += self._cs.complete(call)
        if call is not None:
            self._calls.append(call)
        else:
            self._out.append(raw)
        if call is not None or self._cs.named:
            self._next += 1  # an index whose name went out stays used, even by a broken call
        self._cs = _CallStream(self._next, self._args_re)

    def _flush(self) -> tuple[str, list[ToolCallDelta]]:
        """Content so that the pieces sent, joined, are the content stripped: leading whitespace
        is dropped, trailing whitespace waits until more text follows it."""
        text, deltas = "".join(self._out), self._deltas
        if not self._started:
            text = text.lstrip()
            self._started = bool(text)
        text = self._held + text
        body = text.rstrip()
        self._held, self._out, self._deltas = text[len(body):], [], []
        return body, deltas


_START, _END = "<tool_call>", "</tool_call>"


class HermesStream(_Stream):
    def __init__(self) -> None:
        super().__init__("arguments")
        self._in_call, self._searched = False, 0

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        while True:
            if not self._in_call:
                i = self._buf.find(_START)
                cut = i if i >= 0 else len(self._buf) - _partial(self._buf, _START)
                self._out.append(self._buf[:cut])
                self._buf, self._in_call, self._searched = self._buf[cut:], i >= 0, len(_START)
                if i < 0:
                    return self._flush()
            e = self._buf.find(_END, self._searched)
            if e < 0:
                self._searched = max(len(_START), len(self._buf) - len(_END) + 1)
                stop = len(self._buf) - _partial(self._buf, _END)
                self._deltas += self._cs.advance(self._buf, len(_START), stop)
                return self._flush()
            end = e + len(_END)
            self._end_call(_call(self._buf[len(_START):e], ("arguments",)), self._buf[:end])
            self._buf, self._in_call = self._buf[end:], False

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if self._in_call:
            self._end_call(_call(self._buf[len(_START):], ("arguments",)), self._buf)
        else:
            self._out.append(self._buf)
        self._buf, self._in_call = "", False
        return self._flush()


@dataclass(frozen=True)
class HermesParser:
    name: str = "hermes"

    def parse(self, text: str) -> Parsed:
        parts, calls, pos = [], [], 0
        while (s := text.find(_START, pos)) >= 0:
            parts.append(text[pos:s])
            e = text.find(_END, s + len(_START))
            body_end, pos = (e, e + len(_END)) if e >= 0 else (len(text), len(text))
            call = _call(text[s + len(_START):body_end], ("arguments",))
            if call:
                calls.append(call)
            else:
                parts.append(text[s:pos])
        parts.append(text[pos:])
        return Parsed("".join(parts).strip() or None, calls)

    def streamer(self) -> HermesStream:
        return HermesStream()


_TAG, _SEP, _KEYS = "<|python_tag|>", " \t\n\r;", ("parameters", "arguments")


class Llama3JsonStream(_Stream):
    """States: "lead" (is it calls or content?), "call" (buffer: an object from its `{`),
    "sep" (between calls), "text" (all the rest is content)."""

    def __init__(self) -> None:
        super().__init__("parameters|arguments")
        self._state, self._lead, self._scan = "lead", "", _Scan(0)

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        while self._step():
            pass
        return self._flush()

    def _step(self) -> bool:
        """Move on as far as the buffer decides; True if the state changed (step again)."""
        if self._state == "lead":  # calls if it starts (after whitespace, a tag) with `{`
            i = _skip(self._buf, 0)
            if self._buf.startswith(_TAG, i):
                i = _skip(self._buf, i + len(_TAG))
            elif _TAG.startswith(self._buf[i:]):
                return False  # nothing yet, or maybe the tag's start
            if i == len(self._buf):
                return False
            if self._buf[i] == "{":
                self._state, self._lead, self._buf = "call", self._buf[:i], self._buf[i:]
            else:
                self._state = "text"
            return True
        if self._state == "call":
            end = self._scan.run(self._buf)
            self._deltas += self._cs.advance(self._buf, 0, len(self._buf) if end is None else end)
            if end is None:
                return False
            call = _call(self._buf[:end], _KEYS)
            self._end_call(call, self._lead + self._buf[:end])
            self._buf, self._lead, self._state = self._buf[end:], "", "sep" if call else "text"
            return True
        if self._state == "sep":
            self._buf = self._buf[_skip(self._buf, 0, _SEP):]
            if not self._buf:
                return False
            self._state, self._scan = "call" if self._buf[0] == "{" else "text", _Scan(0)
            return True
        self._out.append(self._buf)
        self._buf = ""
        return False

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if self._state == "call":
            self._end_call(None, self._lead + self._buf)
        elif self._state in ("lead", "text"):
            self._out.append(self._buf)
        self._buf, self._state = "", "text"
        return self._flush()


@dataclass(frozen=True)
class Llama3JsonParser:
    name: str = "llama3_json"

    def parse(self, text: str) -> Parsed:
        i = _skip(text, 0)
        if text.startswith(_TAG, i):
            i = _skip(text, i + len(_TAG))
        calls: list[ToolCall] = []
        while i < len(text) and text[i] == "{":
            end = _Scan(i).run(text)
            call = _call(text[i:end], _KEYS) if end is not None else None
            if call is None:
                break
            calls.append(call)
            i = _skip(text, end, _SEP)
        return Parsed((text[i:] if calls else text).strip() or None, calls)

    def streamer(self) -> Llama3JsonStream:
        return Llama3JsonStream()


PARSERS: dict[str, Callable[[], ToolParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}
"""Tool-call parsers by the name `--tool-call-parser` takes."""


def tool_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r} (valid: {', '.join(PARSERS)})")
    return PARSERS[name]()
