"""The prompt stream of a run as a grain pipeline: sources (prompts or environment episodes) mixed by weight, shuffled, split
across hosts (process p of n takes every n-th prompt, so hosts never share one), iterated with a
state that checkpoints and restores exactly; plus the fixed held-out set per domain."""

from __future__ import annotations

import json
import zlib
from typing import TYPE_CHECKING, Any

import grain

from opd_jax.data.domains import Example
from opd_jax.data.sources import EnvironmentSource, ProceduralSource, read_jsonl

if TYPE_CHECKING:  # the config schema validates domains through opd_jax.data, so no import cycle here
    from opd_jax.config import DataSection, SourceSpec


def _source(spec: SourceSpec, seed: int, split: str) -> grain.MapDataset:
    if spec.builtin is not None:
        return grain.MapDataset.source(ProceduralSource(spec.builtin, seed=seed, split=split, params=spec.params))
    if spec.environment is not None:
        return grain.MapDataset.source(_episodes(spec, seed, split))
    return grain.MapDataset.source(read_jsonl(spec.jsonl, spec.verifier)).shuffle(seed=seed)


def _episodes(spec: SourceSpec, seed: int, split: str) -> EnvironmentSource:
    return EnvironmentSource(spec.environment, domain=spec.domain_name, seed=seed, split=split, params=spec.params)


def train_prompts(data: DataSection, *, process_index: int = 0, process_count: int = 1) -> grain.IterDataset:
    """An endless, deterministic stream of training Examples for this process. Iterate it with
    `iter(...)`; the iterator's get_state()/set_state() checkpoint the position."""
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    parts = [_source(spec, data.seed + i, "train").repeat() for i, spec in enumerate(data.train)]
    mixed = parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, [s.weight for s in data.train])
    return mixed[process_index::process_count].to_iter_dataset()


def _source_seed(spec: SourceSpec) -> int:
    """A seed of the source itself (its domain and parameters), not of its place in a list, so a
    domain's held-out prompts are the same in every run that trains on it, alone or in a mix."""
    name = spec.builtin if spec.environment is None else ["environment", spec.environment]
    return zlib.crc32(json.dumps([name, spec.params], sort_keys=True).encode())


def eval_prompts(data: DataSection) -> dict[str, list[Example]]:
    """The held-out prompts per domain: for built-in domains the first eval_prompts_per_domain of
    their eval stream; for JSONL sources the `eval_jsonl` file when one is given."""
    out: dict[str, list[Example]] = {}
    for spec in data.train:
        if spec.builtin is not None:
            source = ProceduralSource(spec.builtin, seed=data.seed + _source_seed(spec), split="eval",
                                      params=spec.params)
            examples = [source[j] for j in range(data.eval_prompts_per_domain)]
        elif spec.environment is not None:  # held-out episodes: the environment's eval split
            episodes = _episodes(spec, data.seed + _source_seed(spec), "eval")
            examples = [episodes[j] for j in range(data.eval_prompts_per_domain)]
        elif spec.eval_jsonl is not None:
            examples = read_jsonl(spec.eval_jsonl, spec.verifier)
        else:
            continue
        for example in examples:
            out.setdefault(example.domain, []).append(example)
    return out


# validation draws its own stream of each built-in domain's training split
# the fixed draws apart from the training stream, each from a stream of its own seed
_DRAW_SEED_OFFSETS = {"validation": 104_729, "teacher_samples": 130_363}


def validation_prompts(data: DataSection, per_domain: int, *, draw: str = "validation") -> dict[str, list[Example]]:
    """Prompts apart from the held-out set, per domain, for choosing a hyper-parameter (a merge
    scale, say) without looking at the held-out prompts, or for the teachers to answer (draw
    "teacher_samples"): for built-in domains `per_domain` draws from a training stream of the
    draw's own seed, for JSONL sources the file's first lines."""
    offset = _DRAW_SEED_OFFSETS[draw]
    out: dict[str, list[Example]] = {}
    for spec in data.train:
        if spec.builtin is not None:
            source = ProceduralSource(spec.builtin, seed=data.seed + _source_seed(spec) + offset,
                                      split="train", params=spec.params)
            examples = [source[j] for j in range(per_domain)]
        elif spec.environment is not None:
            episodes = _episodes(spec, data.seed + _source_seed(spec) + offset, "train")
            examples = [episodes[j] for j in range(per_domain)]
        else:
            examples = read_jsonl(spec.jsonl, spec.verifier)[:per_domain]
        for example in examples:
            out.setdefault(example.domain, []).append(example)
    return out


def source_domains(spec: SourceSpec) -> set[str]:
    """Every domain a source's prompts (training and held-out) belong to."""
    if spec.builtin is not None:
        return {spec.builtin}
    if spec.environment is not None:
        return {spec.domain_name}
    files = [spec.jsonl] + ([spec.eval_jsonl] if spec.eval_jsonl else [])
    return {e.domain for f in files for e in read_jsonl(f)}


def take(iterator: Any, n: int) -> list[Example]:
    return [next(iterator) for _ in range(n)]
