"""Structured outputs inside the engine, on the real model: constrained and free rows in one
batch, compiles off the step, preemption, and how tools reach a chat template."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest

from tierserve.engine.sampling_params import ParamError, SamplingParams, StructuredOutput
from tierserve.engine.llm import LLM
from tierserve.engine.tokenizer import TextTokenizer
from tierserve.engine.worker.grammar import GrammarError
from tierserve.server.tools import plan_tools, template_messages

PET = {"type": "object", "properties": {
    "species": {"enum": ["cat", "dog", "parrot"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 25},
    "name": {"type": "string", "maxLength": 12}}, "required": ["species", "age", "name"]}


def _slow_schema(tag: str, fields: int = 150) -> dict:
    """A schema xgrammar takes about a second to compile (many patterned strings); `tag` makes it
    new to the compile cache."""
    return {"type": "object", "properties": {
        f"{tag}_{i}": {"type": "string", "pattern": f"[a-z]{{{i % 7 + 1},{i % 11 + 9}}}"}
        for i in range(fields)}}


def test_free_rows_unchanged_by_constrained_rows_in_the_batch(llm, varied_prompts):
    """32 requests, half constrained: the free half's greedy tokens equal a run without them."""
    free = [p[:200] for p in varied_prompts]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    alone = llm.generate(free, greedy)
    spec = StructuredOutput.json(PET)
    mixed = llm.generate(free + free, [greedy] * 16 + [SamplingParams(
        temperature=0, max_tokens=60, structured_outputs=spec)] * 16)
    assert [o.outputs[0].token_ids for o in mixed[:16]] == [o.outputs[0].token_ids for o in alone]
    for o in mixed[16:]:
        jsonschema.validate(json.loads(o.outputs[0].text), PET)


def test_no_row_waits_on_another_rows_compile(llm):
    """A request whose grammar compiles for seconds waits in the queue; the free requests beside
    it produce tokens meanwhile, and it then runs constrained."""
    eng = llm.engine
    spec = StructuredOutput.json(_slow_schema(f"t{time.monotonic_ns()}"))
    fut = eng.compile_grammar(spec)
    eng.add_request("slow", "Fill in the form:", SamplingParams(
        temperature=0, max_tokens=8, structured_outputs=spec))
    for i in range(4):
        eng.add_request(f"free-{i}", f"Story number {i}:", SamplingParams(
            temperature=0, max_tokens=64, ignore_eos=True))
    free_tokens_while_compiling, done = 0, {}
    while eng.has_unfinished_requests():
        compiling = not fut.done()
        outs = eng.step()
        if compiling:
            free_tokens_while_compiling += sum(o.request_id.startswith("free") for o in outs)
        done.update((o.request_id, o) for o in outs if o.finished)
    assert free_tokens_while_compiling >= 4  # at least a step of all four ran during the compile
    assert done["slow"].outputs[0].text.startswith("{")
    assert all(len(done[f"free-{i}"].outputs[0].token_ids) == 64 for i in range(4))


def test_preempted_constrained_requests_stay_valid(varied_prompts):
    tight = LLM(num_blocks=40, max_num_batched_tokens=256)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=80,
                            structured_outputs=StructuredOutput.json(PET))
    outs = tight.generate([p[:120] for p in varied_prompts[:12]], params)
    assert tight.engine.scheduler.num_preemptions > 0
    for o in outs:
        if o.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(o.outputs[0].text), PET)
    assert sum(o.outputs[0].finish_reason == "stop" for o in outs) >= 10
    pool = tight.engine.pool
    assert pool.num_free == pool.num_blocks


def test_offline_refusals_raise(llm):
    with pytest.raises(GrammarError, match="parenthesis"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutput.regex("a(b")))
    with pytest.raises(ParamError) as e:
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutput.regex("a+"))
    assert e.value.param == "min_tokens"
    with pytest.raises(ParamError):
        StructuredOutput.choice([])
    assert llm.engine.num_tracked == 0


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": PET}}
TURNS = [{"role": "user", "content": "Weather in Oslo?"},
         {"role": "assistant", "content": None, "tool_calls": [{
             "id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "4 C"}]


def test_tools_reach_a_template_without_tools_as_text(llm):
    tok = llm.get_tokenizer()
    assert not tok.takes_tools  # SmolLM2's template has no tools variable
    plan = plan_tools([WEATHER], "required", True, False, None)
    messages, variables = template_messages(plan, TURNS, tok.takes_tools)
    text = tok.apply_chat_template(messages, **variables)
    assert '"name": "get_weather"' in text.split("<|im_start|>user")[0]  # the system block
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' \
        in text
    assert "<tool_response>\n4 C\n</tool_response>" in text


def test_a_template_that_takes_tools_gets_them(llm):
    src = llm.get_tokenizer()
    tok = TextTokenizer.__new__(TextTokenizer)
    tok.__dict__.update(src.__dict__)
    tok.set_chat_template(
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
        "{% for c in m.tool_calls or [] %}{{ c.function.arguments.city }}{% endfor %}"
        "{% endfor %}")
    assert tok.takes_tools
    plan = plan_tools([WEATHER], "auto", True, True, "hermes")
    messages, variables = template_messages(plan, TURNS, tok.takes_tools)
    assert tok.apply_chat_template(messages, **variables) == \
        "[get_weather]<user>Weather in Oslo?<assistant>Oslo<tool>4 C"
