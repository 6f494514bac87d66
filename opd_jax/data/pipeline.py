"""The prompt stream of a run as a grain pipeline: sources (prompts or environment episodes) mixed by weight, shuffled, split
across hosts (process p of n takes every n-th prompt, so hosts never share one), iterated with a
state that checkpoints and restores exactly; plus the fixed held-out set per domain."""

from __future__ import annotations

import functools
import json
import zlib
from typing import TYPE_CHECKING, Any

import grain
import numpy as np

from opd_jax.data.domains import Example
from opd_jax.data.sources import DataError, EnvironmentSource, ProceduralSource, read_jsonl, space_text
from opd_jax.data.splits import Partition, distinct, enumerate_space

if TYPE_CHECKING:  # the config schema validates domains through opd_jax.data, so no import cycle here
    from opd_jax.config import DataSection, SourceSpec


def _stream(spec: SourceSpec, data: DataSection, seed: int, split: str) -> ProceduralSource | EnvironmentSource:
    """A built-in domain's or an environment's stream, on the split's side of the run's partition."""
    region = partition(spec, data.seed, data.held_out_share)
    if spec.builtin is not None:
        return ProceduralSource(spec.builtin, seed=seed, split=split, params=spec.params, partition=region)
    return EnvironmentSource(spec.environment, domain=spec.domain_name, seed=seed, split=split, params=spec.params,
                             partition=region)


@functools.lru_cache(maxsize=256)
def _partition(builtin: str | None, environment: str | None, domain: str, params: str, seed: int,
               share: float) -> Partition:
    region = Partition(seed=seed, share=share)
    rng = np.random.default_rng(0)  # any stream that reaches every problem: only the set counts
    if builtin is not None:
        source = ProceduralSource(builtin, params=json.loads(params))
        draw = lambda: source.sample(rng)[0]  # noqa: E731
    else:
        source = EnvironmentSource(environment, domain=domain, params=json.loads(params))
        draw = lambda: source.key_of_seed(int(rng.integers(2**31)))  # noqa: E731
    if source.space is None:
        return region
    space = enumerate_space(draw, source.space)
    return region if space is None else region.exact(space)


def partition(spec: SourceSpec, seed: int, share: float) -> Partition:
    """A source's held-out region under a data seed and share (opd_jax.data.splits): exact in a
    problem space small enough to enumerate."""
    return _partition(spec.builtin, spec.environment, spec.domain_name if spec.environment else "",
                      json.dumps(spec.params, sort_keys=True), seed, share)


def _train_seed(data: DataSection, index: int, seed_offset: int) -> int:
    """The seed of data.train[index]'s training draw (its stream, or a JSONL file's shuffle)."""
    return data.seed + seed_offset + index


def training_stream(data: DataSection, index: int, seed_offset: int = 0) -> ProceduralSource | EnvironmentSource:
    """data.train[index]'s training stream (a built-in domain or an environment) as train_prompts
    draws it: indexable, endless, on the training side of the run's partition."""
    return _stream(data.train[index], data, _train_seed(data, index, seed_offset), "train")


def _source(data: DataSection, index: int, seed_offset: int) -> grain.MapDataset:
    spec = data.train[index]
    if spec.jsonl is None:
        return grain.MapDataset.source(training_stream(data, index, seed_offset))
    rows = grain.MapDataset.source(read_jsonl(spec.jsonl, spec.verifier))
    return rows.shuffle(seed=_train_seed(data, index, seed_offset))


def train_prompts(data: DataSection, *, process_index: int = 0, process_count: int = 1,
                  seed_offset: int = 0) -> grain.IterDataset:
    """An endless, deterministic stream of training Examples for this process, none of them held
    out. Iterate it with `iter(...)`; the iterator's get_state()/set_state() checkpoint the
    position. `seed_offset` moves the streams (a warm start's own draw) but not the held-out region."""
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    parts = [_source(data, i, seed_offset).repeat() for i in range(len(data.train))]
    mixed = parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, [s.weight for s in data.train])
    return mixed[process_index::process_count].to_iter_dataset()


def _source_seed(spec: SourceSpec) -> int:
    """A seed of the source itself (its domain and parameters), not of its place in a list, so a
    domain's held-out prompts are the same in every run that trains on it, alone or in a mix."""
    name = spec.builtin if spec.environment is None else ["environment", spec.environment]
    return zlib.crc32(json.dumps([name, spec.params], sort_keys=True).encode())


# draws in a row that bring no new held-out problem before a region counts as exhausted
_PATIENCE = 2_000


def held_out_count(spec: SourceSpec, data: DataSection) -> int:
    """How many held-out problems the source asks for (its own eval_prompts, else the data section's)."""
    return spec.eval_prompts if spec.eval_prompts is not None else data.eval_prompts_per_domain


def _held_out(spec: SourceSpec, index: int, data: DataSection) -> list[Example]:
    """The source's first held_out_count distinct problems of the held-out region; DataError
    naming the source and its problem space when the region holds fewer."""
    stream = _stream(spec, data, data.seed + _source_seed(spec), "eval")
    count = held_out_count(spec, data)
    found = distinct(lambda j: stream[j], stream.key, count, patience=_PATIENCE)
    if len(found) < count:
        name = spec.builtin or f"environment {spec.environment}"
        raise DataError(f"data.train[{index}] ({name} {spec.params or ''}): {count} held-out problems asked for, but its "
                        f"problem space {space_text(stream.space)} holds only {len(found)} in its held-out share "
                        f"({data.held_out_share:g}); ask for at most {len(found)} "
                        f"(data.train[{index}].eval_prompts or data.eval_prompts_per_domain), raise data.held_out_share "
                        f"(at most 0.5), or widen the domain's params")
    return found


def eval_prompts(data: DataSection) -> dict[str, list[Example]]:
    """The held-out problems per domain, distinct and never trained on: for built-in domains and
    environments the first eval_prompts_per_domain (or the source's eval_prompts) problems of
    their held-out region (opd_jax.data.splits); for JSONL sources the `eval_jsonl` file when one
    is given."""
    out: dict[str, list[Example]] = {}
    for i, spec in enumerate(data.train):
        if spec.jsonl is None:
            examples = _held_out(spec, i, data)
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
    """Prompts outside the held-out region, per domain, for choosing a hyper-parameter (a merge
    scale, say) without looking at the held-out prompts, or for the teachers to answer (draw
    "teacher_samples"): for built-in domains and environments `per_domain` draws from a training
    stream of the draw's own seed, for JSONL sources the file's first lines."""
    offset = _DRAW_SEED_OFFSETS[draw]
    out: dict[str, list[Example]] = {}
    for spec in data.train:
        if spec.jsonl is None:
            source = _stream(spec, data, data.seed + _source_seed(spec) + offset, "train")
            examples = [source[j] for j in range(per_domain)]
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
