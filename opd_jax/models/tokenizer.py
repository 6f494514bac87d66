"""A Hugging Face `tokenizers` tokenizer plus what a chat model needs around it: special tokens,
whether to prepend BOS, and the Jinja chat template, rendered the way transformers renders it."""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2.ext
import jinja2.sandbox
import tokenizers

from opd_jax.models.config import ModelFormatError

Message = dict[str, Any]


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


@dataclasses.dataclass
class Tokenizer:
    backend: tokenizers.Tokenizer
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    chat_template: str | None = None

    # ------------------------------------------------------------------ ids
    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self.token_id(self.pad_token)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    # ------------------------------------------------------------------ text
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True) -> str:
        """Render `messages` with the model's chat template (sandboxed Jinja, as transformers does)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template; pass a plain prompt instead")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=[jinja2.ext.loopcontrols])
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent, ensure_ascii=False)
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat; the template writes its own special tokens."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)

    # ------------------------------------------------------------------ files
    def save(self, directory: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (transformers and SGLang read them)."""
        directory = Path(directory)
        self.backend.save(str(directory / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": self.bos_token,
                  "eos_token": self.eos_token, "pad_token": self.pad_token, "clean_up_tokenization_spaces": False}
        if self.chat_template:
            config["chat_template"] = self.chat_template
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))

    @classmethod
    def from_dir(cls, directory: str | Path) -> Tokenizer | None:
        """The tokenizer saved in a Hugging Face model directory, or None if it has none."""
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.exists():
            return None
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on a bad file
            raise ModelFormatError(f"{path}: cannot be read as a tokenizers file ({e})") from None
        config: dict[str, Any] = {}
        config_path = directory / "tokenizer_config.json"
        if config_path.exists():
            try:
                config = json.loads(config_path.read_text())
            except json.JSONDecodeError as e:
                raise ModelFormatError(f"{config_path}: not valid JSON ({e})") from None
        template = config.get("chat_template")
        template_file = directory / "chat_template.jinja"
        if template is None and template_file.exists():
            template = template_file.read_text()
        return cls(backend=backend, bos_token=_token_text(config.get("bos_token")),
                   eos_token=_token_text(config.get("eos_token")), pad_token=_token_text(config.get("pad_token")),
                   chat_template=template if isinstance(template, str) else None)


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json spells special tokens either as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value
