"""A character-level tokenizer for models trained from scratch on the built-in domains: one token
per printable ASCII character and newline, plus <pad>, <eos> and <unk>."""

from __future__ import annotations

import string

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from opd_jax.models.tokenizer import Tokenizer

SPECIALS = ("<pad>", "<eos>", "<unk>")


def char_tokenizer() -> Tokenizer:
    chars = sorted(set(string.printable) - set("\t\r\x0b\x0c"))
    vocab = {token: i for i, token in enumerate([*SPECIALS, *chars])}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIALS))
    return Tokenizer(backend=backend, eos_token="<eos>", pad_token="<pad>")
