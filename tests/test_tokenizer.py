"""jaxkv.tokenizer.Tokenizer against transformers and llama.cpp's splitting rules."""

import json

import pytest
import regex

from checkpoints.gguf_io import read_gguf_metadata
from checkpoints.gguf_tokenizer import tokenizer_from_gguf
from jaxkv.tokenizer import Tokenizer

PROMPTS = [
    "Hello, world!",
    "The year 2024 had 366 days; π≈3.14159 and 1,000,000 > 999.",
    "  leading spaces,\ttabs\t\tand trailing   ",
    "line one\n\nline two\r\n   indented\n",
    "héllo naïve café — Ünïcödé, 日本語のテキスト, Привет мир, 🤗🚀 emoji",
    "don't I'll we'RE they've",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x**2  # comment\n",
    "",
]

MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi 👋"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "  spaces  and\nnewlines  "},
    ],
]


@pytest.fixture(scope="module")
def smol_info(smollm2_gguf):
    meta = read_gguf_metadata(smollm2_gguf)
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.")}


@pytest.fixture(scope="module")
def smol(smol_info):
    return tokenizer_from_gguf(smol_info)


@pytest.fixture(scope="module")
def hf_smol(smollm2_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


def test_encode_decode_match_transformers(smol, hf_smol):
    for text in PROMPTS:
        ids = smol.encode(text)
        assert ids == hf_smol.encode(text), text
        assert smol.decode(ids, skip_special_tokens=False) == text
        assert smol.decode(ids) == hf_smol.decode(ids, skip_special_tokens=True)
    assert smol.encode("<|im_start|>") == [1]  # control tokens stay whole
    assert smol.encode("12345") == [33, 34, 35, 36, 37]


def test_special_ids(smol):
    assert smol.bos_token_id == 1 and smol.eos_token_ids == (2,)
    assert smol.special_tokens["bos_token"] == "<|im_start|>"
    assert smol.special_tokens["eos_token"] == "<|im_end|>"
    assert smol.vocab_size == 49152


def test_chat_template_matches_transformers(smol, hf_smol):
    for messages in MESSAGES:
        for gen in (True, False):
            text = smol.apply_chat_template(messages, add_generation_prompt=gen)
            assert text == hf_smol.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen
            )
            ids = hf_smol.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)[
                "input_ids"
            ]
            assert smol.encode(text, add_special_tokens=False) == ids
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")


def _llama_cpp_smollm_split(text: str) -> list[str]:
    """llama.cpp's "smollm" pre-tokenizer: each \\p{N} alone, then the GPT-2 regex,
    pieces spelled in the GPT-2 byte alphabet."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()
    gpt2 = regex.compile(
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
    )
    pieces = []
    for chunk in regex.split(r"(\p{N})", text):
        pieces.extend(gpt2.findall(chunk))
    return ["".join(alphabet[b] for b in p.encode("utf-8")) for p in pieces if p]


def test_pre_tokenizer_follows_llama_cpp_smollm(smol, smol_info):
    """The file says tokenizer.ggml.pre == "smollm": digits (every \\p{N}, also ² or ½)
    are split one by one. transformers' GGUF loader ignores that value, so it is
    the reference only for ASCII text; llama.cpp's rule is the spec here."""
    assert smol_info["tokenizer.ggml.pre"] == "smollm"
    pre = smol.tokenizer.pre_tokenizer
    for text in PROMPTS + ["x²³ ½ 12 Ⅻ a1b22", " 2024年", "3rd 4th"]:
        assert [p for p, _ in pre.pre_tokenize_str(text)] == _llama_cpp_smollm_split(text), text


def tiny_gguf_info(extra_merges=(), **overrides):
    """A byte-level vocabulary: 3 specials, the 256 byte symbols, merged tokens
    and a user-defined token; merges "h e", "l l", "he ll", "hell o", "Ġ w" and
    digit merges (so that pre-tokenizers show: "1234" is 123|4 in groups of three,
    12|34 in one piece, 1|2|3|4 digit by digit), then ``extra_merges``."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_tokens = list(bytes_to_unicode().values())
    merged = ["he", "ll", "hell", "hello", "Ġw", "Ġwo", "or", "Ġwor", "12", "123", "34"]
    tokens = ["<s>", "</s>", "<|user|>"] + byte_tokens + merged + ["<think>"]
    info = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (256 + len(merged)) + [4],
        "tokenizer.ggml.merges": [
            "h e",
            "l l",
            "he ll",
            "hell o",
            "Ġ w",
            "1 2",
            "3 4",
            "12 3",
            *extra_merges,
        ],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": "{% for m in messages %}{{ bos_token }}{{ m['content'] }}{{ eos_token }}"
        "{% endfor %}",
    }
    info.update(overrides)
    return info


def test_tiny_gguf_bpe_by_hand():
    info = tiny_gguf_info()
    tok = tokenizer_from_gguf(info)
    idx = {t: i for i, t in enumerate(info["tokenizer.ggml.tokens"])}
    # h e l l o -> he l l o -> he ll o -> hell o -> hello
    assert tok.encode("hello") == [0, idx["hello"]]
    assert tok.encode("hello", add_special_tokens=False) == [idx["hello"]]
    assert tok.encode(" world", add_special_tokens=False) == [
        idx[c] for c in ("Ġw", "o", "r", "l", "d")
    ]
    assert tok.encode("<|user|>hello<think>") == [0, 2, idx["hello"], idx["<think>"]]
    assert tok.decode(tok.encode("<|user|>hello world")) == "hello world"
    assert tok.decode(tok.encode("<|user|>hi"), skip_special_tokens=False) == "<s><|user|>hi"
    assert tok.bos_token_id == 0 and tok.eos_token_ids == (1,)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<s>x</s>"


def test_tiny_gguf_merge_order():
    """Merge ranks decide: Ġ w o r l d with "o r" first gives Ġw or l d; with
    "Ġw o" first it gives Ġwo r -> Ġwor l d."""
    for merges, want in [
        (["o r", "Ġw o", "Ġwo r"], ["Ġw", "or", "l", "d"]),
        (["Ġw o", "Ġwo r", "o r"], ["Ġwor", "l", "d"]),
    ]:
        info = tiny_gguf_info(extra_merges=merges)
        idx = {t: i for i, t in enumerate(info["tokenizer.ggml.tokens"])}
        tok = tokenizer_from_gguf(info)
        assert tok.encode(" world", add_special_tokens=False) == [idx[t] for t in want], merges


def spm_gguf_info():
    """A llama.cpp "llama" (SentencePiece) vocabulary: unk/bos/eos, the 256 byte
    fallback tokens, scored pieces and one extra control token."""
    pieces = {
        "\u2581": -1.0,
        "h": -2,
        "e": -2,
        "l": -2,
        "o": -2,
        "w": -2,
        "r": -2,
        "d": -2,
        "i": -2,
        "!": -3,
        "he": -1.5,
        "ll": -1.2,
        "\u2581h": -1.4,
        "\u2581he": -1.1,
        "llo": -1.0,
        "hell": -1.05,
        "\u2581hello": -0.5,
        "\u2581w": -1.3,
        "or": -1.6,
        "\u2581wor": -0.9,
        "ld": -1.7,
        "\u2581world": -0.4,
        "\u2581\u2581": -2.5,
    }
    tokens = (
        ["<unk>", "<s>", "</s>"]
        + [f"<0x{b:02X}>" for b in range(256)]
        + list(pieces)
        + ["<|user|>"]
    )
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [3],
        "tokenizer.ggml.scores": [0.0] * 259 + [float(v) for v in pieces.values()] + [0.0],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


def write_tokenizer_gguf(path, info):
    """A GGUF file holding only a minimal llama config and the tokenizer ``info``."""
    from gguf import GGUFValueType, GGUFWriter

    w = GGUFWriter(str(path), "llama")
    for key, value in [
        ("block_count", 1),
        ("context_length", 64),
        ("embedding_length", 32),
        ("feed_forward_length", 64),
        ("attention.head_count", 4),
    ]:
        w.add_uint32(f"llama.{key}", value)
    for key, value in info.items():
        if value is None:
            continue
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif key.endswith("token_type"):
            w.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
        else:
            w.add_array(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_sentencepiece_gguf_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    info = spm_gguf_info()
    write_tokenizer_gguf(tmp_path / "spm.gguf", info)
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    ours = tokenizer_from_gguf(info)
    for text in [
        "hello world",
        " hello  world!",
        "hello\nworld \u00e9\U0001f600",
        "<|user|>hello world</s>",
        "",
        "  ",
        "hi",
        "world hello<s>x",
    ]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    idx = {t: i for i, t in enumerate(info["tokenizer.ggml.tokens"])}
    # by hand: BOS, then the highest-scored pieces; \n and \u00e9 fall back to bytes
    assert ours.encode("hello world") == [1, idx["\u2581hello"], idx["\u2581world"]]
    assert ours.encode("i\n\u00e9", add_special_tokens=False) == [
        idx["\u2581"],
        idx["i"],
        idx["<0x0A>"],
        idx["<0xC3>"],
        idx["<0xA9>"],
    ]


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2"])
def test_byte_level_pre_tokenizers_match_transformers(tmp_path, pre):
    """transformers' GGUF loader knows these pre-tokenizer names too."""
    ids = {"gpt2": ["12", "34"], "llama-bpe": ["123", "4"], "qwen2": ["1", "2", "3", "4"]}[pre]
    from transformers import AutoTokenizer

    info = tiny_gguf_info(extra_merges=["o r", "Ġw o", "Ġwo r"], **{"tokenizer.ggml.pre": pre})
    del info["tokenizer.chat_template"]
    write_tokenizer_gguf(tmp_path / "bpe.gguf", info)
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file="bpe.gguf")
    ours = tokenizer_from_gguf(info)
    idx = {t: i for i, t in enumerate(info["tokenizer.ggml.tokens"])}
    assert ours.encode("1234", add_special_tokens=False) == [idx[t] for t in ids]
    for text in PROMPTS + ["hello world", "HELLO  world\n\n\tx", "1234567 abc12 x²"]:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text)) == theirs.decode(
            theirs.encode(text), skip_special_tokens=True
        )


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("tokenizer.ggml.model", "bert", "bert"),
        ("tokenizer.ggml.tokens", [], "tokens"),
        ("tokenizer.ggml.model", "llama", "scores"),  # SentencePiece without scores
        ("tokenizer.ggml.pre", "mystery-pre", "mystery-pre"),
    ],
)
def test_unsupported_gguf_tokenizer(key, value, match):
    with pytest.raises(ValueError, match=match):
        tokenizer_from_gguf(tiny_gguf_info(**{key: value}))


def test_files_round_trip(smol, tmp_path):
    smol.to_files(tmp_path / "tok")
    back = Tokenizer.from_files(tmp_path / "tok")
    for text in PROMPTS:
        assert back.encode(text) == smol.encode(text)
    assert (back.bos_token_id, back.eos_token_ids) == (smol.bos_token_id, smol.eos_token_ids)
    assert back.chat_template == smol.chat_template
    assert back.apply_chat_template(MESSAGES[1]) == smol.apply_chat_template(MESSAGES[1])


# Whitespace control, loop variables, raise_exception and the special token strings:
# the parts of a template whose rendering depends on the environment's settings.
TRICKY_TEMPLATE = """\
{%- if messages[0]['role'] == 'system' %}
    {{- bos_token + '[SYS]' + messages[0]['content'] }}
{% endif %}
{% for m in messages %}
    {% if m['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + m['role']) }}
    {% endif %}
    {% if m['role'] != 'system' %}
        <{{ m['role'] }}>{{ m['content'] | trim }}{% if not loop.last %}{{ eos_token }}{% endif %}

    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
    <assistant>
{% endif %}
"""


@pytest.fixture(scope="module")
def hf_dir(smol, tmp_path_factory):
    d = tmp_path_factory.mktemp("hf_tok")
    (d / "tokenizer.json").write_text(smol.tokenizer.to_str())
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "chat_template": TRICKY_TEMPLATE,
            }
        )
    )
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return d


def test_from_hf_dir_matches_transformers(hf_dir):
    from transformers import AutoTokenizer

    ours = Tokenizer.from_hf_dir(hf_dir)
    theirs = AutoTokenizer.from_pretrained(hf_dir)
    assert ours.bos_token_id == 1 and ours.eos_token_ids == (2, 0)
    for messages in MESSAGES:
        for gen in (True, False):
            assert ours.apply_chat_template(
                messages, add_generation_prompt=gen
            ) == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    for text in PROMPTS:
        assert ours.encode(text) == theirs.encode(text)
    with pytest.raises(ValueError, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_hf_dir_token_dicts_and_template_file(hf_dir, tmp_path):
    import shutil

    d = shutil.copytree(hf_dir, tmp_path / "d")
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"__type": "AddedToken", "content": "<|im_start|>"},
                "eos_token": {"__type": "AddedToken", "content": "<|im_end|>"},
            }
        )
    )
    (d / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    tok = Tokenizer.from_hf_dir(d)
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2, 0)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x"


def test_no_template_and_sandbox():
    tok = tokenizer_from_gguf(tiny_gguf_info(**{"tokenizer.chat_template": None}))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    evil = tokenizer_from_gguf(
        tiny_gguf_info(
            **{"tokenizer.chat_template": "{{ messages.__class__.__mro__[1].__subclasses__() }}"}
        )
    )
    with pytest.raises(ValueError):
        evil.apply_chat_template([{"role": "user", "content": "x"}])
