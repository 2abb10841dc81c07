"""Tokenizer and chat template, from a GGUF's metadata or a Hugging Face tokenizer.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Sequence

from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers


@dataclass
class TokenizerInfo:
    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    add_bos: bool


class TextTokenizer:
    """Encode, decode and apply the chat template; the one tokenizer interface of the engine."""

    def __init__(self, info: TokenizerInfo):
        self._tok = info.tokenizer
        self.chat_template = info.chat_template
        self.bos_token = info.bos_token
        self.eos_token = info.eos_token
        self.add_bos = info.add_bos
        self.bos_token_id = self._tok.token_to_id(info.bos_token) if info.bos_token else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._template = None
        self.takes_tools = False
        """The chat template reads a `tools` variable (it describes tools its own way)."""
        if self.chat_template:
            self._template = _template_env().from_string(self.chat_template)
            self.takes_tools = _reads_tools(self.chat_template)

    def set_chat_template(self, text: str) -> None:
        """Use `text` in place of the model's template; a syntax error is a ValueError."""
        self._template, self.chat_template = compile_chat_template(text), text
        self.takes_tools = _reads_tools(text)

    @property
    def backend(self) -> Tokenizer:
        """The `tokenizers` object (the grammar compiler reads its vocabulary)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # A tokenizer.json may add BOS in its post-processor (Llama 3); a GGUF-built one has none
        # and says so with add_bos instead. The check below keeps BOS from doubling.
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **variables) -> str:
        """The prompt text; `variables` are more template variables (enable_thinking=False),
        never one of TEMPLATE_VARIABLES."""
        if self._template is None:
            raise ValueError("this model has no chat template; use /v1/completions")
        return self._template.render(variables, messages=messages,
                                     add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")


TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "bos_token", "eos_token")
"""What apply_chat_template always sets."""


def compile_chat_template(text: str):
    """The template, compiled as transformers would; a syntax error is a ValueError."""
    from jinja2 import TemplateSyntaxError

    try:
        return _template_env().from_string(text)
    except TemplateSyntaxError as e:
        raise ValueError(f"the template does not parse: {e} (line {e.lineno})") from None


def _reads_tools(text: str) -> bool:
    from jinja2 import meta

    return "tools" in meta.find_undeclared_variables(_template_env().parse(text))


def _raise(message: str) -> None:
    raise ValueError(message)


class _GenerationTag(Extension):
    """{% generation %}...{% endgeneration %} marks assistant text for training masks in HF; when
    rendering a prompt it is just its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _template_env() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in, so prompts match it exactly."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


_WORDS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_SPLIT_REGEX = {"llama-bpe": _WORDS + r"\p{N}{1,3}" + _REST, "qwen2": _WORDS + r"\p{N}" + _REST}

# GGUF token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
_SPECIAL_TYPES = {2, 3, 4}


def from_gguf_fields(tokens: list[str], types: list[int], merges: list[str], model: str,
                     pre: str | None, bos_id: int | None, eos_id: int | None, add_bos: bool,
                     chat_template: str | None) -> TokenizerInfo:
    """A byte-level BPE tokenizer ('gpt2' GGUF tokenizers: Llama 3, SmolLM, Qwen2...)."""
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (supported: 'gpt2' BPE)")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=(pre == "llama-bpe")))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in _SPLIT_REGEX:
        split = pre_tokenizers.Split(Regex(_SPLIT_REGEX[pre]), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty in _SPECIAL_TYPES])
    name = lambda i: tokens[i] if i is not None and 0 <= i < len(tokens) else None
    return TokenizerInfo(tok, chat_template, name(bos_id), name(eos_id), add_bos)
