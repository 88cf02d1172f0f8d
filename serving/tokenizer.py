"""Prompt text to token ids for the serving API.

Two tokenizers, picked by `load_tokenizer`:
  * `ByteTokenizer`: UTF-8 bytes as token ids 0..255 (the built-in `tiny` model has V = 256);
    it has no special tokens;
  * `HFTokenizer`: a Hugging Face `tokenizer.json` from a local model directory, through the
    `tokenizers` library (never downloaded), with the special tokens its `tokenizer_config.json`
    asks for.

Special tokens (issue #18: "BOS added when the tokenizer's config says so"): when
`tokenizer_config.json` names `add_bos_token` or `add_eos_token`, the post-processor of
`tokenizer.json` is replaced by one that adds exactly `bos_token` before and `eos_token` after the
text as those flags say, so a BOS the file's own post-processor adds is never doubled and
`add_bos_token: false` removes it. This is transformers 4.x's `LlamaTokenizerFast` (and Gemma's,
...) `update_post_processor`, and 5.x's `TokenizersBackend.update_post_processor` when the flags
are given (`transformers/tokenization_utils_tokenizers.py`). When the config names neither flag,
`tokenizer.json`'s post-processor decides (a Llama 3 file adds its BOS, a Qwen3 file adds nothing),
as in every transformers version. (transformers 5.x's `from_pretrained` drops the two flags
whenever a `tokenizer.json` exists, since its `save_pretrained` writes them into the file's
post-processor; the two rules differ only for a checkpoint whose config and file disagree.)
`encode(text, add_special_tokens=False)` skips them, as `apply_chat_template` does for the
rendered chat text, which holds `bos_token` itself.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from types import MappingProxyType

# The named special tokens of a Hugging Face tokenizer (`SPECIAL_TOKENS_ATTRIBUTES`), which
# `apply_chat_template` passes to the chat template.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")


class ByteTokenizer:
    """Byte-level tokenizer: token id = UTF-8 byte value, so `vocab_size` must be >= 256.

    Args:
      vocab_size: the model's vocabulary size V (ids must be < V).

    Raises:
      ValueError: `vocab_size < 256`.
    """

    name = "byte"
    special_tokens: Mapping[str, str] = MappingProxyType({})  # none: no BOS, no EOS

    def __init__(self, vocab_size: int = 256):
        if vocab_size < 256:
            raise ValueError(f"vocab_size must be >= 256 for byte-level tokens, got {vocab_size}")
        self.vocab_size = int(vocab_size)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`text` -> its UTF-8 bytes as ints in [0, 256) (there are no special tokens to add).

        Raises:
          UnicodeEncodeError: `text` holds a lone surrogate.
        """
        del add_special_tokens
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        """Token ids -> text; ids >= 256 and invalid UTF-8 become U+FFFD."""
        data = bytes(t for t in token_ids if 0 <= t < 256)
        return data.decode("utf-8", errors="replace") + "\ufffd" * sum(
            1 for t in token_ids if not 0 <= t < 256)


class HFTokenizer:
    """A Hugging Face fast tokenizer read from `tokenizer.json`, with the special tokens of its
    `tokenizer_config.json` (see the module docstring for the rule).

    Args:
      path: the `tokenizer.json` file.
      config: the parsed `tokenizer_config.json` (`read_tokenizer_config`); None or {}: the
        file's own post-processor decides, no named special tokens.

    Attributes:
      special_tokens: the named special tokens as strings (`bos_token`, `eos_token`, ...; those
        the config sets), as Hugging Face's `special_tokens_map` gives them to a chat template.

    Raises:
      FileNotFoundError: the file does not exist.
      ValueError: the config adds a BOS or EOS token that is not in the file's vocabulary.
    """

    name = "tokenizer.json"

    def __init__(self, path: str | os.PathLike, config: dict | None = None):
        from tokenizers import Tokenizer

        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer file {os.fspath(path)!r} does not exist")
        self._tok = Tokenizer.from_file(os.fspath(path))
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        config = config or {}
        self.special_tokens = {k: t for k in SPECIAL_TOKEN_NAMES
                               if (t := _token_text(config.get(k))) is not None}
        if "add_bos_token" in config or "add_eos_token" in config:
            self._tok.post_processor = self._template_processing(
                bool(config.get("add_bos_token")), bool(config.get("add_eos_token")), path)

    def _template_processing(self, add_bos: bool, add_eos: bool, path):
        """transformers' `update_post_processor`: `[bos] $A [eos]` (a flag without its token
        adds nothing)."""
        from tokenizers import processors

        marks = []
        for name, wanted in (("bos_token", add_bos), ("eos_token", add_eos)):
            token = self.special_tokens.get(name) if wanted else None
            token_id = None if token is None else self._tok.token_to_id(token)
            if token is not None and token_id is None:
                raise ValueError(f"{name} {token!r} of the tokenizer config is not in the "
                                 f"vocabulary of {os.fspath(path)!r}")
            marks.append(None if token is None else (token, token_id))
        bos, eos = marks

        def seq(name: str, type_id: int) -> str:  # "[<s>:i ]$X:i[ </s>:i]"
            parts = [f"{m[0]}:{type_id}" if m else None for m in (bos, eos)]
            return " ".join(p for p in (parts[0], f"${name}:{type_id}", parts[1]) if p)

        single, pair = seq("A", 0), f"{seq('A', 0)} {seq('B', 1)}"
        return processors.TemplateProcessing(single=single, pair=pair,
                                             special_tokens=[m for m in marks if m])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`text` -> token ids; with `add_special_tokens` the BOS / EOS the tokenizer adds
        (module docstring), as vLLM's completions and `/tokenize` do by default.

        Raises:
          UnicodeEncodeError: `text` holds a lone surrogate (`tokenizers` would raise TypeError).
        """
        try:
            encoding = self._tok.encode(text, add_special_tokens=add_special_tokens)
        except TypeError:
            text.encode("utf-8")  # names the lone surrogate, as ByteTokenizer does
            raise
        return list(encoding.ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Token ids -> text, special tokens kept."""
        return self._tok.decode(list(token_ids), skip_special_tokens=False)


def _token_text(value) -> str | None:
    """A special token of a tokenizer config: a string, an `AddedToken` dict (its `content`),
    or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_tokenizer_config(model_dir: str | os.PathLike | None) -> dict:
    """`model_dir/tokenizer_config.json` as a dict, its missing named special tokens taken from a
    legacy `special_tokens_map.json` beside it; {} when neither file exists or `model_dir` is None.

    Raises:
      ValueError: a file that is not a JSON object.
    """
    if model_dir is None:
        return {}
    config = _json_object(os.path.join(model_dir, "tokenizer_config.json"))
    legacy = _json_object(os.path.join(model_dir, "special_tokens_map.json"))
    return {**{k: v for k, v in legacy.items() if k in SPECIAL_TOKEN_NAMES}, **config}


def _json_object(path: str) -> dict:
    """The JSON object in `path`, {} when there is no such file.

    Raises:
      ValueError: the file is not a JSON object.
    """
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def load_tokenizer(model_dir: str | None, vocab_size: int):
    """The tokenizer for a model: `model_dir/tokenizer.json` (with `tokenizer_config.json`'s
    special tokens) when given, else byte-level.

    Args:
      model_dir: a local checkpoint directory, or None for the built-in model.
      vocab_size: the model's V.

    Raises:
      FileNotFoundError: `model_dir` has no `tokenizer.json`.
      ValueError: byte-level tokens do not fit the vocabulary (V < 256); a tokenizer config that
        is not a JSON object or adds a token missing from the vocabulary.
    """
    if model_dir is None:
        return ByteTokenizer(vocab_size)
    return HFTokenizer(os.path.join(model_dir, "tokenizer.json"), read_tokenizer_config(model_dir))
