"""Prompt text to token ids for the serving API.

Two tokenizers, picked by `load_tokenizer`:
  * `ByteTokenizer`: UTF-8 bytes as token ids 0..255 (the built-in `tiny` model has V = 256);
  * `HFTokenizer`: a Hugging Face `tokenizer.json` from a local model directory, through the
    `tokenizers` library (never downloaded).
"""

from __future__ import annotations

import os
from collections.abc import Sequence


class ByteTokenizer:
    """Byte-level tokenizer: token id = UTF-8 byte value, so `vocab_size` must be >= 256.

    Args:
      vocab_size: the model's vocabulary size V (ids must be < V).

    Raises:
      ValueError: `vocab_size < 256`.
    """

    name = "byte"

    def __init__(self, vocab_size: int = 256):
        if vocab_size < 256:
            raise ValueError(f"vocab_size must be >= 256 for byte-level tokens, got {vocab_size}")
        self.vocab_size = int(vocab_size)

    def encode(self, text: str) -> list[int]:
        """`text` -> its UTF-8 bytes as ints in [0, 256)."""
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        """Token ids -> text; ids >= 256 and invalid UTF-8 become U+FFFD."""
        data = bytes(t for t in token_ids if 0 <= t < 256)
        return data.decode("utf-8", errors="replace") + "\ufffd" * sum(
            1 for t in token_ids if not 0 <= t < 256)


class HFTokenizer:
    """A Hugging Face fast tokenizer read from `tokenizer.json` (no special tokens added).

    Raises:
      FileNotFoundError: the file does not exist.
    """

    name = "tokenizer.json"

    def __init__(self, path: str | os.PathLike):
        from tokenizers import Tokenizer  # optional dependency of the serving binary

        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer file {os.fspath(path)!r} does not exist")
        self._tok = Tokenizer.from_file(os.fspath(path))
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=False)


def load_tokenizer(model_dir: str | None, vocab_size: int):
    """The tokenizer for a model: `model_dir/tokenizer.json` when given, else byte-level.

    Args:
      model_dir: a local checkpoint directory, or None for the built-in model.
      vocab_size: the model's V.

    Raises:
      FileNotFoundError: `model_dir` has no `tokenizer.json`.
      ValueError: byte-level tokens do not fit the vocabulary (V < 256).
    """
    if model_dir is None:
        return ByteTokenizer(vocab_size)
    return HFTokenizer(os.path.join(model_dir, "tokenizer.json"))
