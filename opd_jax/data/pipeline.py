"""The prompt stream of a run as a grain pipeline: sources mixed by weight, shuffled, split
across hosts (process p of n takes every n-th prompt, so hosts never share one), iterated with a
state that checkpoints and restores exactly; plus the fixed held-out set per domain."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import grain

from opd_jax.data.domains import Example
from opd_jax.data.sources import ProceduralSource, read_jsonl

if TYPE_CHECKING:  # the config schema validates domains through opd_jax.data, so no import cycle here
    from opd_jax.config import DataSection, SourceSpec


def _source(spec: SourceSpec, seed: int, split: str) -> grain.MapDataset:
    if spec.builtin is not None:
        return grain.MapDataset.source(ProceduralSource(spec.builtin, seed=seed, split=split, params=spec.params))
    return grain.MapDataset.source(read_jsonl(spec.jsonl)).shuffle(seed=seed)


def train_prompts(data: DataSection, *, process_index: int = 0, process_count: int = 1) -> grain.IterDataset:
    """An endless, deterministic stream of training Examples for this process. Iterate it with
    `iter(...)`; the iterator's get_state()/set_state() checkpoint the position."""
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    parts = [_source(spec, data.seed + i, "train").repeat() for i, spec in enumerate(data.train)]
    mixed = parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, [s.weight for s in data.train])
    return mixed[process_index::process_count].to_iter_dataset()


def eval_prompts(data: DataSection) -> dict[str, list[Example]]:
    """The held-out prompts per domain: for built-in domains the first eval_prompts_per_domain of
    their eval stream; for JSONL sources the `eval_jsonl` file when one is given."""
    out: dict[str, list[Example]] = {}
    for i, spec in enumerate(data.train):
        if spec.builtin is not None:
            source = ProceduralSource(spec.builtin, seed=data.seed + i, split="eval", params=spec.params)
            examples = [source[j] for j in range(data.eval_prompts_per_domain)]
        elif spec.eval_jsonl is not None:
            examples = read_jsonl(spec.eval_jsonl)
        else:
            continue
        for example in examples:
            out.setdefault(example.domain, []).append(example)
    return out


def take(iterator: Any, n: int) -> list[Example]:
    return [next(iterator) for _ in range(n)]
