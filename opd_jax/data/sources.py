"""Prompt sources: JSONL files of {prompt or messages, answer, domain} and the built-in
procedural domains, as random-access sequences a grain pipeline can index, shuffle and shard."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from opd_jax.data.domains import EpisodeSpec, Example, get_domain
from opd_jax.errors import OpdJaxError

SPLITS = {"train": 0, "eval": 1}


class DataError(OpdJaxError, ValueError):
    """A prompt file that cannot be used; the message names the file and line."""


def utf8_line(raw: bytes, number: int) -> str:
    """Line `number` (1-based) of a JSONL file as text; a BOM on the first (Windows editors) is no
    error. ValueError naming the byte and column of text that is not UTF-8."""
    try:
        return raw.decode("utf-8-sig" if number == 1 else "utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); save the file as "
                         f"UTF-8") from None


def json_problem(error: json.JSONDecodeError) -> str:
    """'<what> at column N: ...<the text there>...' for a one-line JSON document."""
    line = error.doc.splitlines()[error.lineno - 1] if error.doc.splitlines() else ""
    start = max(0, error.colno - 21)
    shown = ("..." if start else "") + line[start:error.colno + 20] + ("..." if error.colno + 20 < len(line) else "")
    return f"{error.msg} at column {error.colno}: {shown.strip()!r}"


def _message_list(value: Any, where: str) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        raise DataError(f"{where}: \"messages\" must be a non-empty list of {{role, content}} strings")
    return tuple({"role": m["role"], "content": m["content"]} for m in value)


def read_jsonl(path: str | Path, verifier: str | None = None) -> list[Example]:
    """Every example of a JSONL prompt file. Each non-blank line is an object with "prompt" (a
    string) or "messages" (chat turns), "answer" (string or number) and optionally "domain"
    (default: the file's stem). A bad line raises DataError naming file:line. `verifier` (exact,
    numeric, math) judges its responses; None: numeric for numeric answers, else exact."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such prompt file")
    examples = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"{path}:{number}"
            try:
                line = utf8_line(raw, number)
            except ValueError as e:
                raise DataError(f"{where}: {e}") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({json_problem(e)})") from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: each line must be a JSON object")
            if ("prompt" in record) == ("messages" in record):
                raise DataError(f"{where}: needs exactly one of \"prompt\" and \"messages\"")
            if "answer" not in record:
                raise DataError(f"{where}: missing \"answer\"")
            answer = record["answer"]
            if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
                raise DataError(f"{where}: \"answer\" must be a string or a number")
            prompt = record.get("prompt")
            if prompt is not None and not isinstance(prompt, str):
                raise DataError(f"{where}: \"prompt\" must be a string")
            messages = _message_list(record["messages"], where) if "messages" in record else None
            domain = record.get("domain", path.stem)
            if not isinstance(domain, str) or not domain:
                raise DataError(f"{where}: \"domain\" must be a non-empty string")
            examples.append(Example(prompt=prompt, answer=str(answer), domain=domain, messages=messages,
                                    uid=f"{path.name}:{number}", verifier=verifier))
    if not examples:
        raise DataError(f"{path}: holds no examples")
    return examples


class ProceduralSource(Sequence):
    """Example i of a built-in domain's stream: drawn from np.random.default_rng([seed, split, i]),
    so any host can produce any index, and train and eval streams never share a generator."""

    def __init__(self, domain: str, *, seed: int = 0, split: str = "train", size: int = 10**9,
                 params: dict[str, Any] | None = None):
        self.domain = get_domain(domain)
        self.sample = self.domain.sampler(**(params or {}))
        self.seed, self.split, self.size = seed, SPLITS[split], size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Example:
        if not 0 <= index < self.size:
            raise IndexError(index)
        prompt, answer = self.sample(np.random.default_rng([self.seed, self.split, index]))
        return Example(prompt=prompt, answer=answer, domain=self.domain.name,
                       uid=f"{self.domain.name}/{'train' if self.split == 0 else 'eval'}/{index}")


class EnvironmentSource(Sequence):
    """Episode i of an environment's stream: its seed drawn from np.random.default_rng([seed,
    split, i]), so any host can create any episode, and training and held-out episodes differ."""

    def __init__(self, environment: str, *, domain: str, seed: int = 0, split: str = "train", size: int = 10**9,
                 params: dict[str, Any] | None = None):
        self.environment, self.domain, self.params = environment, domain, dict(params or {})
        self.seed, self.split, self.size = seed, split, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Example:
        if not 0 <= index < self.size:
            raise IndexError(index)
        episode_seed = int(np.random.default_rng([self.seed, SPLITS[self.split], index]).integers(2**31))
        return Example(prompt=None, answer="", domain=self.domain, uid=f"{self.domain}/{self.split}/{index}",
                       episode=EpisodeSpec(self.environment, self.params, episode_seed, self.split))
