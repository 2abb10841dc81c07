"""Tokenizer and chat template, from a GGUF's metadata or a Hugging Face tokenizer.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Mapping, Sequence

from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors)


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
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4
_SPECIAL_TYPES = {_UNKNOWN, _CONTROL, _USER_DEFINED}
"""What the byte-level BPE vocabularies add as special tokens."""

SPACE = "\u2581"
"""How a SentencePiece vocabulary spells a space ('▁')."""

MERGE_IN_FILE_ORDER = ("gemma", "gemma2", "gemma3")
"""Architectures whose SentencePiece pieces merge in the order the vocabulary lists them, not in
the order of their scores: Gemma's control and user-defined tokens all score -1000, which puts its
runs of spaces behind thousands of words. transformers' GGUF converter orders them so; on
gemma-3-270m, by score about one varied string in four tokenizes unlike it, in this order none."""


def from_gguf_fields(fields: Mapping[str, Any]) -> TokenizerInfo:
    """The tokenizer a GGUF's tokenizer.* metadata describes (llama.cpp's key names): 'gpt2' is
    byte-level BPE (Llama 3, SmolLM, Qwen2...), 'llama' SentencePiece BPE (Gemma, Llama 2,
    Mistral)."""
    key = lambda k, default=None: fields.get(f"tokenizer.ggml.{k}", default)
    model, tokens = key("model"), list(key("tokens") or [])
    types = [int(t) for t in key("token_type", [])] or [_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"{len(tokens)} tokens but {len(types)} token types")
    if model == "gpt2":
        tok = _byte_level_bpe(tokens, types, key("merges") or [], key("pre"))
    elif model == "llama":
        tok = _sentencepiece_bpe(tokens, types, _merge_ranks(fields, len(tokens)),
                                 bool(key("add_space_prefix", True)),
                                 _name(tokens, key("unknown_token_id")))
    else:
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported "
                         f"(supported: 'gpt2' BPE, 'llama' SentencePiece BPE)")
    eos = _name(tokens, key("eos_token_id"))
    if key("add_eos_token", False) and eos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"$A {eos}", pair=f"$A {eos} $B {eos}",
            special_tokens=[(eos, int(key("eos_token_id")))])
    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
    add_bos = bool(key("add_bos_token", model == "llama"))
    return TokenizerInfo(tok, fields.get("tokenizer.chat_template"),
                         _name(tokens, key("bos_token_id")), eos, add_bos)


def _name(tokens: list[str], i: int | None) -> str | None:
    return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None


def _byte_level_bpe(tokens: list[str], types: list[int], merges: list[str],
                    pre: str | None) -> Tokenizer:
    """GPT-2's byte-level BPE with the file's merges, split as llama.cpp's `pre` names."""
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
    return tok


def _sentencepiece_bpe(tokens: list[str], types: list[int], ranks: list[float],
                       space_prefix: bool, unk: str | None) -> Tokenizer:
    """SentencePiece BPE as llama.cpp runs it: spaces become '▁', a '▁' goes before the text and
    after each special token when the file's add_space_prefix asks (Llama 2, Mistral; not Gemma),
    and a character outside the vocabulary becomes its UTF-8 bytes' <0xNN> tokens."""
    # llama.cpp's converter writes '▁' in user-defined tokens as a space (Gemma's runs of spaces):
    # spelled back, they merge from the '▁'s the normalizer makes, as transformers does.
    spelled = [t.replace(" ", SPACE) if ty == _USER_DEFINED else t for t, ty in zip(tokens, types)]
    vocab = {t: i for i, t in enumerate(spelled)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_spm_merges(vocab, spelled, ranks),
                               unk_token=unk, fuse_unk=True, byte_fallback=True))
    spaces = normalizers.Replace(" ", SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if space_prefix \
        else spaces
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if space_prefix else steps)
    # Matched whole in the text, before the normalizer (llama.cpp: tokenizer_st_partition).
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty in (_UNKNOWN, _CONTROL)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, s, ty in zip(tokens, spelled, types) if ty == _USER_DEFINED and t == s])
    return tok


def _merge_ranks(fields: Mapping[str, Any], n: int) -> list[float]:
    """Each token's rank as a merge result, the best lowest: minus its score, or its id for
    MERGE_IN_FILE_ORDER."""
    scores = fields.get("tokenizer.ggml.scores")
    if fields.get("general.architecture") in MERGE_IN_FILE_ORDER or scores is None:
        return list(range(n))
    if len(scores) != n:
        raise ValueError(f"{n} tokens but {len(scores)} scores")
    return [-float(s) for s in scores]


def _spm_merges(vocab: dict[str, int], spelled: list[str],
                ranks: list[float]) -> list[tuple[str, str]]:
    """SentencePiece merges the adjacent pair whose union is the best-ranked token; as BPE
    merges: every split of a token into two tokens, ranked as the token (ties: the longer left
    part first, then the lower id, as transformers ranks them)."""
    merges = []
    for i, piece in enumerate(spelled):
        if vocab[piece] != i:  # a repeated spelling: the last id is the one BPE gives
            continue
        merges.extend((ranks[i], -k, piece[:k], piece[k:]) for k in range(1, len(piece))
                      if piece[:k] in vocab and piece[k:] in vocab)
    merges.sort(key=lambda m: m[:2])
    return [m[2:] for m in merges]
