"""BOS / EOS as the checkpoint's tokenizer config says (issue #18), on tiny tokenizer directories
built here with the `tokenizers` library: `add_bos_token` adds one BOS, a BOS the file's
post-processor already adds is not doubled, Qwen3-style configs add none, chat text rendered with
`bos_token` is tokenized without adding another, and `/tokenize` takes `add_special_tokens`.
Where transformers is installed, its tokenizer gives the same ids."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from serving.api_chat import ChatTemplate, chat_prompt_ids, load_chat_template
from serving.api_tokens import add_token_routes
from serving.tokenizer import ByteTokenizer, load_tokenizer

VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "<|im_end|>": 5, "[": 6,
         "]": 7, "user": 8}
BOS, EOS, HELLO, WORLD = 1, 2, 3, 4
TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} "
            "{% endfor %}")
MESSAGES = [{"role": "user", "content": "hello world"}]


def _tokenizer_dir(path, config: dict | None, bos_processor: bool):
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>", "</s>", "<|im_end|>", "[", "]"])
    if bos_processor:  # as Llama 3's tokenizer.json: the file itself adds the BOS
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)])
    tok.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE, **config}))
    return str(path)


LLAMA = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>"}
LLAMA_ADDED = {**LLAMA, "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False,
                                      "normalized": False, "rstrip": False, "single_word": False}}
QWEN3 = {"add_bos_token": False, "bos_token": None, "eos_token": "<|im_end|>"}
CASES = [  # (config, the file's post-processor adds BOS, ids of "hello world")
    pytest.param(LLAMA, False, [BOS, HELLO, WORLD], id="add_bos_token"),
    pytest.param(LLAMA_ADDED, True, [BOS, HELLO, WORLD], id="add_bos_token+file_adds_bos"),
    pytest.param({**LLAMA, "add_bos_token": False}, True, [HELLO, WORLD], id="config_says_no"),
    pytest.param({"bos_token": "<s>"}, True, [BOS, HELLO, WORLD], id="file_decides_bos"),
    pytest.param({"bos_token": "<s>"}, False, [HELLO, WORLD], id="file_decides_none"),
    pytest.param(None, True, [BOS, HELLO, WORLD], id="no_config"),
    pytest.param(QWEN3, False, [HELLO, WORLD], id="qwen3"),
    pytest.param({**LLAMA, "add_eos_token": True}, True, [BOS, HELLO, WORLD, EOS], id="bos+eos"),
]


@pytest.mark.parametrize("config, file_adds_bos, want", CASES)
def test_special_tokens_follow_the_config(tmp_path, config, file_adds_bos, want):
    tok = load_tokenizer(_tokenizer_dir(tmp_path, config, file_adds_bos), 16)
    assert tok.encode("hello world") == want
    assert tok.encode("hello world", add_special_tokens=False) == [HELLO, WORLD]


@pytest.mark.parametrize("config, file_adds_bos, want", CASES[:4] + CASES[6:7])
def test_chat_text_holds_one_bos(tmp_path, config, file_adds_bos, want):
    model_dir = _tokenizer_dir(tmp_path, config, file_adds_bos)
    tok = load_tokenizer(model_dir, 16)
    ids = chat_prompt_ids(ChatTemplate(load_chat_template(model_dir)), tok, MESSAGES, True)
    bos = [BOS] if (config or {}).get("bos_token") else []  # the template writes bos_token
    assert ids == bos + [6, 8, 7, HELLO, WORLD]


def test_qwen3_config_names_no_bos(tmp_path):
    tok = load_tokenizer(_tokenizer_dir(tmp_path, QWEN3, False), 16)
    assert tok.special_tokens == {"eos_token": "<|im_end|>"}
    assert ChatTemplate(TEMPLATE).render(MESSAGES, True, tok.special_tokens) == \
        "[user] hello world "


def test_legacy_special_tokens_map_and_errors(tmp_path):
    model_dir = _tokenizer_dir(tmp_path, {"add_bos_token": True}, False)
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    tok = load_tokenizer(model_dir, 16)
    assert tok.encode("hello") == [BOS, HELLO]
    assert tok.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"add_bos_token": True, "bos_token": "<bos>"}))
    with pytest.raises(ValueError, match="bos_token '<bos>'.*not in the vocabulary"):
        load_tokenizer(model_dir, 16)
    (tmp_path / "tokenizer_config.json").write_text("[]")
    with pytest.raises(ValueError, match="not a JSON object"):
        load_tokenizer(model_dir, 16)


def test_a_lone_surrogate_is_a_unicode_error(tmp_path):
    """The API answers a `UnicodeError` with 400 (not `tokenizers`' TypeError, a 500)."""
    tok = load_tokenizer(_tokenizer_dir(tmp_path, LLAMA, True), 16)
    with pytest.raises(UnicodeEncodeError):
        tok.encode("hello \ud800")
    with pytest.raises(ValueError):  # the chat endpoint's 400 for `messages`
        chat_prompt_ids(ChatTemplate(TEMPLATE), tok, [{"role": "user", "content": "\ud800"}],
                        True)


def test_byte_tokenizer_has_no_special_tokens():
    tok = ByteTokenizer(256)
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False) == [104, 105]
    assert chat_prompt_ids(ChatTemplate(TEMPLATE), tok, MESSAGES, True) == list(
        b"[user] hello world ")


def test_tokenize_endpoint_takes_add_special_tokens(tmp_path):
    tok = load_tokenizer(_tokenizer_dir(tmp_path, LLAMA, True), 16)

    def error(status, message, param):
        raise AssertionError(message)

    app = FastAPI()
    add_token_routes(app, tokenizer=tok, vocab_size=16, max_model_len=64,
                     check_model=lambda name: None, error=error)
    with TestClient(app) as c:
        default = c.post("/tokenize", json={"prompt": "hello world"}).json()
        plain = c.post("/tokenize", json={"prompt": "hello world",
                                          "add_special_tokens": False}).json()
        bad = c.post("/tokenize", json={"prompt": "x", "add_special_tokens": "no"})
    assert default["tokens"] == [BOS, HELLO, WORLD] and default["count"] == 3
    assert plain["tokens"] == [HELLO, WORLD]
    assert bad.status_code == 422


# A checkpoint whose config and tokenizer.json agree (as every file transformers writes does):
# transformers (5.x drops the config's flags when a tokenizer.json exists) gives the same ids.
CONSISTENT = [CASES[i] for i in (1, 3, 4, 5, 6)]


@pytest.mark.parametrize("config, file_adds_bos, want", CONSISTENT)
def test_same_ids_as_transformers(tmp_path, config, file_adds_bos, want):
    transformers = pytest.importorskip("transformers", reason="transformers not installed")
    model_dir = _tokenizer_dir(tmp_path, config, file_adds_bos)
    ref = transformers.PreTrainedTokenizerFast.from_pretrained(model_dir)
    tok = load_tokenizer(model_dir, 16)
    assert ref("hello world")["input_ids"] == tok.encode("hello world") == want
    if config is None:
        return
    text = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == ChatTemplate(load_chat_template(model_dir)).render(
        MESSAGES, True, tok.special_tokens)
    assert ref(text, add_special_tokens=False)["input_ids"] == chat_prompt_ids(
        ChatTemplate(load_chat_template(model_dir)), tok, MESSAGES, True)


@pytest.mark.parametrize("config, file_adds_bos, want", [c for c in CASES if c.values[0]])
def test_same_ids_as_transformers_update_post_processor(tmp_path, config, file_adds_bos, want):
    """Every case, against transformers' own rule for flags given to the tokenizer
    (`update_post_processor`, which 4.x's Llama tokenizer applies to the config's flags)."""
    transformers = pytest.importorskip("transformers", reason="transformers not installed")
    model_dir = _tokenizer_dir(tmp_path, config, file_adds_bos)
    kwargs = {k: v["content"] if isinstance(v, dict) else v for k, v in config.items()}
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=f"{model_dir}/tokenizer.json",
                                               **kwargs)
    assert ref("hello world")["input_ids"] == load_tokenizer(model_dir, 16).encode(
        "hello world") == want
