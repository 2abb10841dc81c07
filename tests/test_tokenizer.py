"""The tokenizer built from the embedded GGUF's metadata encodes, decodes and renders chats exactly
as transformers does from the same file."""

from __future__ import annotations

import os

import pytest

from tierserve.engine.worker.loaders import load_model_source
from tierserve.engine.tokenizer import TextTokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "12345",
    "3.14159 and 2,718,281 and 1e-9",
    "Call 555-0199 before 10:30pm on 2024-02-29.",
    "def add(a, b):\n    return a + b\n",
    "for (int i = 0; i < n; ++i) { sum += x[i]; }",
    "import numpy as np\nx = np.zeros((3, 4), dtype=np.float32)",
    "if x == 1:\n\tprint('tab')\n",
    "   leading spaces",
    "trailing spaces   ",
    "many     spaces   between",
    "\n\n\nnewlines\n\n",
    "\r\nwindows line\r\nendings",
    "mixed \t\n whitespace \n\t ",
    "",
    " ",
    "Café naïve résumé Straße",
    "Привет, мир!",
    "日本語のテキストと中文字符",
    "한국어 문장입니다",
    "مرحبا بالعالم",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧‍👦",
    "math: ∑ x² ≤ ∞ → π ≈ 3.14",
    "<|im_start|>user\nHi<|im_end|>\n",
    "<|im_start|>assistant\nSure!<|im_end|><|endoftext|>",
    "text<|im_end|>more text",
    "don't won't I'm you're we've they'll he'd",
    "DON'T SHOUT",
    "URL: https://example.com/path?q=1&r=two#frag",
    "email someone@example.org",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "<html><body><p>Hi</p></body></html>",
    "a" * 50,
    "ababababababab",
    "$$$ ### @@@ !!!",
    "snake_case_name and CamelCaseName",
    "0x1F 0b1010 007",
    "The year 1999 became 2000.",
    "Ellipsis… and — dashes – here",
]


@pytest.fixture(scope="module")
def ours() -> TextTokenizer:
    return TextTokenizer(load_model_source("smollm2-135m").tokenizer)


@pytest.fixture(scope="module")
def hf_parse():
    """transformers' tokenizer from the GGUF, and the configs its GGUF parser gave on the way
    (recorded, not replaced: the slow parse is paid once here and checked below)."""
    from conftest import recorded_gguf_parse

    path = load_model_source("smollm2-135m").path
    with recorded_gguf_parse() as seen:
        tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                         gguf_file=os.path.basename(path))
    return tok, seen, path


@pytest.fixture(scope="module")
def hf(hf_parse):
    return hf_parse[0]


def test_the_reference_models_config_is_transformers_own(hf_parse):
    """conftest's hf_config (transformers' GGUF key table applied to read_gguf's fields, 8 s
    faster) gives the config transformers' own GGUF parser gives."""
    from conftest import hf_config

    from tierserve.engine.worker.loaders.gguf_file import read_gguf

    _, seen, path = hf_parse
    assert seen, "transformers no longer parses the GGUF through load_gguf_checkpoint"
    theirs = transformers.AutoConfig.for_model(**seen[0]).to_dict()
    mine = hf_config(read_gguf(path).fields).to_dict()
    names = {"_name_or_path", "_model_name_or_path", "unk_token_id", "transformers_version"}
    assert {k: v for k, v in theirs.items() if k not in names} == \
        {k: v for k, v in mine.items() if k not in names}
    assert mine["rope_theta" if "rope_theta" in mine else "rope_parameters"] is not None


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_encode_matches_transformers(ours, hf, text):
    assert ours.encode(text) == hf.encode(text, add_special_tokens=True)


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_decode_round_trips(ours, text):
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


def test_digits_are_single_tokens(ours):
    assert [ours.decode([i]) for i in ours.encode("12345")] == list("12345")


def test_special_tokens_are_single_ids_and_skipped_in_decode(ours, hf):
    ids = ours.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == hf.convert_tokens_to_ids("<|im_start|>")
    assert ids[-1] == hf.convert_tokens_to_ids("<|im_end|>")
    assert ours.decode(ids) == "user\nHi"


CHATS = {
    "system-user-assistant": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
    "user-only": [{"role": "user", "content": "Tell me a joke about cats 🐱"}],
}


@pytest.mark.parametrize("chat", list(CHATS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, hf, chat, add_generation_prompt):
    messages = CHATS[chat]
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == hf.apply_chat_template(messages, tokenize=False,
                                          add_generation_prompt=add_generation_prompt)
    assert ours.encode(text) == hf.encode(text, add_special_tokens=True)


def test_user_only_chat_gets_default_system_prompt(ours):
    text = ours.apply_chat_template(CHATS["user-only"])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>assistant\n")


# Uses what Hugging Face templates use beyond plain Jinja: loop controls, a tojson that does not
# escape HTML characters, {% generation %} blocks, raise_exception.
FEATURE_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}{% continue %}{% endif %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('bad role') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{% endif %}"
    "{% if m.meta is defined %} {{ m.meta | tojson }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_template_features_match_transformers(ours, hf):
    from tierserve.engine.tokenizer import TokenizerInfo

    info = TokenizerInfo(ours._tok, FEATURE_TEMPLATE, ours.bos_token, ours.eos_token, ours.add_bos)
    custom = TextTokenizer(info)
    messages = [{"role": "user", "content": "x < y & z", "meta": {"tag": "<b>é</b>", "n": [1, 2]}},
                {"role": "tool", "content": "skipped"},
                {"role": "assistant", "content": "ok"}]
    expected = hf.apply_chat_template(messages, chat_template=FEATURE_TEMPLATE, tokenize=False,
                                      add_generation_prompt=True)
    assert custom.apply_chat_template(messages) == expected
    assert '"<b>é</b>"' in expected
    with pytest.raises(ValueError, match="bad role"):
        custom.apply_chat_template([{"role": "robot", "content": "beep"}])
