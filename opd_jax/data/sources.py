"""Prompt sources: JSONL files of {prompt or messages, answer, domain} and the built-in
procedural domains, as random-access sequences a grain pipeline can index, shuffle and shard."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from opd_jax.data.domains import EpisodeSpec, Example, get_domain
from opd_jax.data.splits import Partition
from opd_jax.errors import OpdJaxError

T = TypeVar("T")

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
    if error.pos >= len(error.doc.rstrip("\r\n")):  # the parser ran off the end of the line
        return f"the line ends before its JSON does: {error.msg}; a closing brace, bracket or quote is missing?"
    lines = error.doc.split("\n")  # not splitlines(): a line cut short ends at a newline it does not hold
    line = lines[error.lineno - 1] if error.lineno <= len(lines) else ""
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


def _redrawn(partition: Partition, split: str, attempt: Callable[[int], T], key: Callable[[T], str],
             what: str, space: int | None) -> T:
    item = partition.draw(split, attempt, key)
    if item is None:
        raise DataError(f"{what}: its problem space {space_text(space)} holds no {'held-out' if split == 'eval' else 'training'} "
                        f"problem at data.held_out_share {partition.share}; give it a larger problem space")
    return item


def space_text(space: int | None) -> str:
    """'of N problems' (or 'of unknown size'), as the split errors name a problem space."""
    return "of unknown size" if space is None else f"of {space:,} problems"


class ProceduralSource(Sequence):
    """Example i of a built-in domain's stream: drawn from np.random.default_rng([seed, split, i,
    attempt]) for attempt 0, 1, ... until the problem lies on the split's side of the partition
    (held out for "eval", not held out otherwise; opd_jax.data.splits), so any host can produce
    any index, and no held-out problem is ever in a training stream."""

    def __init__(self, domain: str, *, seed: int = 0, split: str = "train", size: int = 10**9,
                 params: dict[str, Any] | None = None, partition: Partition = Partition()):
        self.domain = get_domain(domain)
        self.sample = self.domain.sampler(**(params or {}))
        self.seed, self.split, self.size, self.partition = seed, split, size, partition
        self.what = f"{self.domain.name} {params or {}}"

    @property
    def space(self) -> int:
        """How many distinct prompts the domain with these parameters has."""
        return self.sample.space

    def __len__(self) -> int:
        return self.size

    def key(self, example: Example) -> str:
        """What makes two of its examples the same problem: the prompt."""
        return example.prompt

    def __getitem__(self, index: int) -> Example:
        if not 0 <= index < self.size:
            raise IndexError(index)
        split = SPLITS[self.split]
        prompt, answer = _redrawn(self.partition, self.split,
                                  lambda n: self.sample(np.random.default_rng([self.seed, split, index, n])),
                                  lambda drawn: drawn[0], self.what, self.space)
        return Example(prompt=prompt, answer=answer, domain=self.domain.name,
                       uid=f"{self.domain.name}/{self.split}/{index}")


class EnvironmentSource(Sequence):
    """Episode i of an environment's stream: its seed drawn from np.random.default_rng([seed,
    split, i, attempt]) until the episode's content (the environment's `problem_key()`, or the
    seed where it has none) lies on the split's side of the partition, so any host can create
    any episode, and no held-out episode is ever trained on."""

    def __init__(self, environment: str, *, domain: str, seed: int = 0, split: str = "train", size: int = 10**9,
                 params: dict[str, Any] | None = None, partition: Partition = Partition()):
        from opd_jax.envs.protocol import load_environment  # envs import opd_jax.data's records

        self.environment, self.domain, self.params = environment, domain, dict(params or {})
        self.seed, self.split, self.size, self.partition = seed, split, size, partition
        self.factory = load_environment(environment)
        space = getattr(self.factory, "problem_space", None)
        self.space = space(**self.params) if space is not None else None

    def __len__(self) -> int:
        return self.size

    def key_of_seed(self, episode_seed: int) -> str:
        if not hasattr(self.factory, "problem_key"):
            return f"{self.environment}\0seed {episode_seed}"
        return f"{self.environment}\0{self.factory(episode_seed, self.split, **self.params).problem_key()}"

    def key(self, example: Example) -> str:
        """What makes two of its episodes the same problem: the environment's problem_key() (its
        map, its secret), else the episode's seed."""
        return self.key_of_seed(example.episode.seed)

    def __getitem__(self, index: int) -> Example:
        if not 0 <= index < self.size:
            raise IndexError(index)
        split = SPLITS[self.split]
        episode_seed = _redrawn(
            self.partition, self.split,
            lambda n: int(np.random.default_rng([self.seed, split, index, n]).integers(2**31)),
            self.key_of_seed, f"environment {self.environment} {self.params}", self.space)
        return Example(prompt=None, answer="", domain=self.domain, uid=f"{self.domain}/{self.split}/{index}",
                       episode=EpisodeSpec(self.environment, self.params, episode_seed, self.split))


def problem_key(example: Example) -> str:
    """What makes two examples the same problem: a prompt's text (or messages), an episode's
    content."""
    if example.episode is not None:
        raise ValueError("an episode's problem key is its environment's (EnvironmentSource)")
    return example.prompt if example.prompt is not None else json.dumps(example.messages)
