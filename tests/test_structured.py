"""Structured outputs and tools through a real server with the official openai client.

Every constrained answer is checked the way its client would: a Pydantic parse and jsonschema for
schemas, json.loads for json_object, the regex itself, the choice list, xgrammar's own acceptance
of an EBNF grammar's output, and the tool's parameter schema for tool calls."""

from __future__ import annotations

import enum
import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from server_fixtures import MODEL, run_server, scrape

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 24}},
                   "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


class Species(str, enum.Enum):
    cat = "cat"
    dog = "dog"
    parrot = "parrot"


class Pet(BaseModel):
    species: Species
    age: int = Field(ge=0, le=25)


class Address(BaseModel):
    city: str = Field(max_length=20)
    floor: int = Field(ge=-2, le=40)


class Person(BaseModel):
    name: str = Field(max_length=20)
    address: Address
    pets: list[Pet] = Field(min_length=1, max_length=3)
    rating: int = Field(ge=1, le=5)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with run_server(tmp_path_factory.mktemp("structured"), "--enable-auto-tool-choice",
                    "--tool-call-parser", "hermes", "--max-n", "64") as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="none", max_retries=0, timeout=300)


def _chat(client, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 200)
    return client.chat.completions.create(model=MODEL, **kw)


def test_parse_pydantic_50_samples_at_temperature_1(client):
    r = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Invent a person with pets."}],
        response_format=Person, temperature=1.0, n=50, seed=7, max_tokens=400)
    schema = Person.model_json_schema()
    assert len(r.choices) == 50
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        assert isinstance(c.message.parsed, Person)
        jsonschema.validate(json.loads(c.message.content), schema)
    assert len({c.message.content for c in r.choices}) > 10  # sampled, not one answer


def test_json_object_outputs_parse(client):
    """Every answer that ends parses to an object; a greedy 135M model can loop on a key until
    max_tokens (cut JSON is no parse), so sampled answers are asked for, most of which end."""
    ended = 0
    for text in ("Return a JSON object with your name and age.", "Describe a car as JSON.",
                 "Give me a JSON object about a city."):
        r = _chat(client, response_format={"type": "json_object"}, temperature=0.7, seed=1, n=2,
                  max_tokens=300, messages=[{"role": "user", "content": text}])
        for c in r.choices:
            assert c.message.content.startswith("{")
            if c.finish_reason == "stop":
                assert isinstance(json.loads(c.message.content), dict)
                ended += 1
    assert ended >= 3


def test_regex_and_choice_on_both_routes(client):
    pattern = r"[A-Z][a-z]{2,8}-\d{3}"
    r = client.completions.create(model=MODEL, prompt="A product code:", max_tokens=30, n=4,
                                  temperature=1.0, seed=3, extra_body={"guided_regex": pattern})
    for c in r.choices:
        assert re.fullmatch(pattern, c.text), c.text
    r = _chat(client, n=4, temperature=1.0, seed=3, extra_body={
        "structured_outputs": {"regex": pattern}})
    for c in r.choices:
        assert re.fullmatch(pattern, c.message.content), c.message.content
    r = client.completions.create(model=MODEL, prompt="Two words:", max_tokens=30, stop=[" "],
                                  extra_body={"guided_regex": "[a-z]{2,6} [a-z]{2,6}"})
    assert re.fullmatch("[a-z]{2,6}", r.choices[0].text) and r.choices[0].stop_reason == " "
    choices = ["sunny", "rainy", "partly cloudy"]
    r = _chat(client, n=6, temperature=1.0, seed=5, extra_body={"guided_choice": choices})
    assert all(c.message.content in choices for c in r.choices)
    r = client.completions.create(model=MODEL, prompt="Is the sky blue?", max_tokens=10,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].text in ("yes", "no")


def test_ebnf_outputs_parse_with_the_same_grammar(client):
    import xgrammar as xgr

    grammar = ('root ::= term (op term){0,3}\nop ::= " + " | " - "\n'
               'term ::= num | "(" num op num ")"\nnum ::= [1-9] [0-9]{0,2}')
    r = client.completions.create(model=MODEL, prompt="An arithmetic expression:", n=6,
                                  temperature=1.0, seed=11, max_tokens=60,
                                  extra_body={"guided_grammar": grammar})
    g = xgr.Grammar.from_ebnf(grammar)
    for c in r.choices:
        assert c.finish_reason == "stop", c.text
        assert xgr.testing._is_grammar_accept_string(g, c.text), c.text
        assert re.fullmatch(r"[0-9()+\- ]+", c.text)


def _validate_calls(calls, tools=(WEATHER, TIME)):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def _stream_calls(client, **kw):
    """The streamed answer reassembled the way the openai client's users do: by index."""
    calls, finish, content = {}, None, ""
    for chunk in _chat(client, stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "args": ""})
                assert d.id is None or d.id == c["id"]
                c["args"] += d.function.arguments or ""
    return calls, finish, content


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}},
                                    "required"], ids=["named", "required"])
def test_forced_tool_calls_validate_streamed_and_not(client, choice):
    r = _chat(client, tools=[WEATHER, TIME], tool_choice=choice, n=4, temperature=1.0, seed=2,
              parallel_tool_calls=False)
    for c in r.choices:
        assert c.finish_reason == "tool_calls", c.message
        assert len(c.message.tool_calls) == 1
        _validate_calls(c.message.tool_calls)
        if isinstance(choice, dict):
            assert c.message.tool_calls[0].function.name == "get_weather"
    calls, finish, _ = _stream_calls(client, tools=[WEATHER, TIME], tool_choice=choice,
                                     temperature=0)
    assert finish == "tool_calls" and len(calls) >= 1
    schemas = {"get_weather": WEATHER, "get_time": TIME}
    for c in calls.values():
        assert c["id"].startswith("call_")
        jsonschema.validate(json.loads(c["args"]), schemas[c["name"]]["function"]["parameters"])


def test_required_parallel_calls_each_validate(client):
    r = _chat(client, tools=[WEATHER, TIME], tool_choice="required", temperature=0.8, seed=4,
              max_tokens=160)
    c = r.choices[0]
    _validate_calls(c.message.tool_calls)  # complete calls validate; a cut-off one is content


def _asked_and_called(i: int, city: str) -> list[dict]:
    return [{"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": f"call_{i}", "type": "function", "function": {
                    "name": "get_weather",
                    "arguments": json.dumps({"city": city, "unit": "celsius"})}}]}]


FEW_SHOT = [*_asked_and_called(1, "London"), *_asked_and_called(2, "Rome"),
            {"role": "user", "content": "What is the weather in Paris?"}]


def test_auto_parses_the_models_own_hermes_calls(client):
    """Earlier calls are templated (the history above) and the model, shown the format, calls
    the tool on its own; the hermes parser turns its text into tool_calls, streamed or not."""
    r = _chat(client, messages=FEW_SHOT, tools=[WEATHER], temperature=0, max_tokens=60)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.message.content
    assert c.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(c.message.tool_calls[0].function.arguments)["city"] == "Paris"
    calls, finish, _ = _stream_calls(client, messages=FEW_SHOT, tools=[WEATHER], temperature=0,
                                     max_tokens=60)
    assert finish == "tool_calls"
    assert [(v["name"], v["args"]) for v in calls.values()] == [
        (t.function.name, t.function.arguments) for t in c.message.tool_calls]


def test_tool_results_are_accepted(client):
    messages = [*FEW_SHOT[:2], {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
                {"role": "user", "content": "And in Paris?"}]
    r = _chat(client, messages=messages, tools=[WEATHER], max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 100  # the tool block, the call and its result are in it


def test_tool_choice_none_is_plain_text(client):
    r = _chat(client, tools=[WEATHER], tool_choice="none", max_tokens=12, temperature=0)
    assert r.choices[0].message.tool_calls == [] and r.choices[0].finish_reason == "length"


def test_logprobs_are_the_masked_distributions(client):
    r = _chat(client, extra_body={"guided_choice": ["yes", "no"]}, logprobs=True,
              top_logprobs=5, temperature=0)
    first = r.choices[0].logprobs.content[0]
    allowed = [t for t in first.top_logprobs if t.logprob > -9999.0]
    assert {t.token for t in allowed} <= {"yes", "no", "y", "n", "ye"}
    assert abs(sum(2.718281828 ** t.logprob for t in allowed) - 1.0) < 1e-3
    assert all(t.logprob == -9999.0 for t in first.top_logprobs if t not in allowed)


def test_seeded_and_prefix_cached_requests_repeat(client):
    kw = dict(response_format={"type": "json_schema", "json_schema": {
        "name": "pet", "schema": Pet.model_json_schema()}}, temperature=1.0, seed=9, n=3)
    a, b = _chat(client, **kw), _chat(client, **kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert b.usage.prompt_tokens_details.cached_tokens > 0
    for c in a.choices:
        Pet.model_validate_json(c.message.content)


BAD = [
    ("schema-not-json-schema", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": 5}}}},
     "response_format.json_schema.schema"),
    ("unknown-response-format", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("regex-does-not-compile", {"structured_outputs": {"regex": "[a-"}},
     "structured_outputs.regex"),
    ("tool-choice-not-in-tools", {"tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ("tool-schema-refused", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "frob"}}}}}],
        "tool_choice": "required"}, "tools[0].function.parameters"),
    ("grammar-undefined-rule", {"guided_grammar": "root ::= missing"}, "guided_grammar"),
    ("two-forms", {"guided_regex": "a+", "response_format": {"type": "json_object"}},
     "guided_regex"),
    ("min-tokens-with-grammar", {"guided_regex": "a+", "min_tokens": 2}, "min_tokens"),
]


@pytest.mark.parametrize("extra,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_structured_input_is_a_400_naming_the_field(server, extra, param):
    r = httpx.post(server.v1 + "/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": ASK, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert "Traceback" not in r.text


def test_serves_on_and_counts(client, server):
    assert _chat(client, max_tokens=3).choices[0].message.content
    m = scrape(server)
    assert m["tierserve:structured_requests_total"] > 0
    assert m["tierserve:grammar_compile_seconds_count"] > 0
    assert m["tierserve:grammar_cache_hits_total"] > 0
    assert m["tierserve:grammar_mask_seconds_total"] > 0
    assert m["tierserve:http_errors_total{status=400}"] >= len(BAD)
    assert not [k for k in m if k.startswith("tierserve:http_errors_total{status=5")]
    assert "Traceback" not in server.log()
