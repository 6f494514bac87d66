"""The teachers of an OPD merge, behind one `score(batch, teacher_index)`: local JAX models on the
trainer's mesh, or SGLang servers scored through the bridge. Either way each teacher sees only
the rows routed to it, and its answer is checked (finite log-probabilities, ≤ 0) before it
can reach training, with the teacher named when it is not."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from opd_jax.config.opd_pipeline import TeachersSection
from opd_jax.core import OPDConfig, RolloutBatch, teacher_scores
from opd_jax.core.opd_step import DistillLoss
from opd_jax.errors import OpdJaxError
from opd_jax.merge.plan import TeacherSpec
from opd_jax.merge.routing import check_teacher_compatible
from opd_jax.models import Decoder, ModelConfig, ModelFormatError, Tokenizer, load_model
from opd_jax.models.adapter_io import load_adapter
from opd_jax.models.lora import bank, is_adapter
from opd_jax.models.weights import build_from_params
from opd_jax.parallel import DEFAULT_RULES, batch_shardings, batch_shards, shard, tree_shardings, under_mesh
from opd_jax.train import sglang_engine
from rollout_bridge.pipe import EngineThread
from rollout_bridge.protocol import EngineError


class TeacherError(OpdJaxError, RuntimeError):
    """A teacher that cannot be loaded or whose scores cannot be trained on; names the teacher."""


def load_teacher(name: str, path: str | Path, dtype: str, *, weights: bool = True
                 ) -> tuple[Decoder | ModelConfig, Tokenizer | None]:
    """The teacher's model (or, with weights=False, only its config) and tokenizer; a checkpoint
    that will not load is a TeacherError naming the teacher and the path."""
    path = Path(path)
    try:
        if weights:
            return load_model(path, dtype=dtype)
        return ModelConfig.from_json(path / "config.json"), Tokenizer.from_dir(path)
    except (ModelFormatError, ValueError, OSError, KeyError) as e:
        raise TeacherError(f"teacher {name!r}: the checkpoint at {path} will not load: {e}") from None


def load_local_teachers(specs: Sequence[TeacherSpec], dtype: str) -> list[tuple[Decoder, Tokenizer | None]]:
    """Each teacher's model and tokenizer. A LoRA expert (its export holds adapter/, in PEFT's
    format, whose base is a directory) is its base plus its adapter, and experts on one base share
    that base's arrays: ten LoRA experts hold one base and ten adapters."""
    bases: dict[Path, tuple[Decoder, Tokenizer | None]] = {}
    out = []
    for spec in specs:
        adapter = Path(spec.path) / "adapter"
        base_path = _adapter_base(adapter)
        if base_path is None:
            out.append(load_teacher(spec.name, spec.path, dtype))
            continue
        if base_path not in bases:
            bases[base_path] = load_teacher(spec.name, base_path, dtype)
        base, tokenizer = bases[base_path]
        pure = nnx.to_pure_dict(nnx.state(base, nnx.Param))  # the base's arrays, not copies
        model = build_from_params(Decoder, base.config, pure, compute_dtype=base.backbone.compute_dtype)
        try:
            out.append((load_adapter(model, adapter), tokenizer))
        except ModelFormatError as e:
            raise TeacherError(f"teacher {spec.name!r}: its adapter will not load: {e}") from None
    return out


def _adapter_base(adapter: Path) -> Path | None:
    """The base directory a PEFT adapter directory names, or None (no adapter, or its base is not a
    directory here: the export's merged weights are used instead)."""
    try:
        base = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return Path(base).resolve() if isinstance(base, str) and (Path(base) / "config.json").exists() else None


def _check_scores(name: str, rows: np.ndarray, scores: dict[str, np.ndarray], mask: np.ndarray) -> None:
    """Every log-probability a teacher gave on a response token is finite and ≤ 0."""
    on = mask > 0
    for field, values in scores.items():
        if field == "teacher_ids":
            continue
        where = on if values.ndim == 2 else on[..., None]
        for problem, bad in (("NaN or inf", ~np.isfinite(values)), ("positive", values > 1e-3)):
            bad = np.any((bad & where).reshape(len(rows), -1), axis=1)
            if np.any(bad):
                raise TeacherError(f"teacher {name!r} gave {problem} log-probabilities ({field}) on response "
                                   f"tokens of sample(s) {', '.join(map(str, rows[bad][:8]))}")


def _to_host(tree: Any) -> Any:
    if jax.process_count() > 1:
        return multihost_utils.process_allgather(tree, tiled=True)
    return jax.device_get(tree)


class Teachers(Protocol):
    names: list[str]

    def score(self, batch: RolloutBatch, teacher_index: np.ndarray) -> dict[str, np.ndarray]:
        """DistillBatch's teacher fields (host arrays, zero off the response mask) for the rows of
        `batch`, row b scored by teacher teacher_index[b]."""
        ...

    def close(self) -> None:
        ...


@functools.partial(jax.jit, static_argnames=("graphdef", "loss", "top_k", "temperature", "microbatches"))
def _score(graphdef, params, batch, adapter_ids, *, loss, top_k, temperature, microbatches):
    return teacher_scores(graphdef, params, batch, loss=loss, top_k=top_k, temperature=temperature,
                          microbatches=microbatches, adapter_ids=adapter_ids)


def _groups(models: Sequence[Decoder]) -> list[list[int]]:
    """The teachers that run as one call: LoRA teachers on one base's arrays (the same arrays, one
    LoraConfig, no adapters on routed experts) form a bank; any other teacher runs alone."""
    groups: dict[Any, list[int]] = {}
    for i, model in enumerate(models):
        key: Any = i
        if model.config.lora is not None and not any(is_adapter(k) and k.startswith("expert_")
                                                     for k in vars(model.backbone.layers)):
            base = nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
            key = (dataclasses.replace(model.config.lora, dropout=0.0),  # scoring draws no dropout
                   tuple(id(x) for x in jax.tree.leaves(base)))
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def _banked(models: Sequence[Decoder]) -> Decoder:
    """One decoder on the first model's base arrays holding every model's adapters as a bank."""
    model = nnx.merge(*nnx.split(models[0]))  # new modules on the same arrays
    for name, param in bank([m.backbone.layers for m in models]).items():
        setattr(model.backbone.layers, name, param)
    return model


class LocalTeachers:
    """Teachers as JAX models on the mesh, each one's parameters sharded by the logical-axis rules
    (many small teachers, or a few large ones). The rows of a batch are grouped by teacher on the
    host; only the teachers a batch needs run, padded to a power-of-two bucket (a multiple of the
    data-parallel shards and micro-batches) so a few compiled shapes serve every step. LoRA
    teachers on one base are one bank: the base is placed once and all their rows run in one
    call, each row with its teacher's adapter (`models.lora.project`'s rows). Teachers of one
    architecture share the compiled scoring function."""

    def __init__(self, names: Sequence[str], models: Sequence[Decoder], mesh: Mesh, *, loss: DistillLoss,
                 top_k: int = 32, temperature: float = 1.0, microbatches: int = 1, rules=DEFAULT_RULES,
                 banks: bool = True):
        self.names = list(names)
        self.mesh, self.rules = mesh, rules
        self.options = {"loss": loss, "top_k": top_k, "temperature": temperature, "microbatches": microbatches}
        # banks=False: a call per teacher even on one base (what benchmarks/bench_lora_teachers.py sets beside it)
        self.groups = _groups(models) if banks else [[i] for i in range(len(models))]
        self._graphdefs, self._params = [], []
        placed: dict[int, jax.Array] = {}  # id(array) -> its placement: teachers sharing a base hold it once

        def place(sharding: Any, variable: Any) -> Any:
            def once(x: jax.Array) -> jax.Array:
                if id(x) not in placed:
                    placed[id(x)] = shard(x, sharding)
                return placed[id(x)]
            return jax.tree.map(once, variable)

        for group in self.groups:
            model = models[group[0]] if len(group) == 1 else _banked([models[i] for i in group])
            graphdef, params = nnx.split(model, nnx.Param)
            self._graphdefs.append(graphdef)
            self._params.append(jax.tree.map(place, tree_shardings(params, mesh, rules), params,
                                             is_leaf=lambda x: isinstance(x, NamedSharding)))
        self.nbytes = sum(x.nbytes for x in placed.values())  # what the teachers hold on the mesh
        self._granule = math.lcm(batch_shards(mesh, rules), microbatches)
        self._vocab = models[0].config.vocab_size
        self._call = under_mesh(_score, mesh, rules)

    def _bucket(self, n: int) -> int:
        return self._granule * (1 << max(0, math.ceil(math.log2(math.ceil(n / self._granule)))))

    def score(self, batch: RolloutBatch, teacher_index: np.ndarray) -> dict[str, np.ndarray]:
        host = jax.tree.map(np.asarray, batch.unpacked())  # each teacher's rows are no packing group
        B, T = host.tokens.shape
        loss, k = self.options["loss"], self.options["top_k"]
        out = {"logp_teacher": np.zeros((B, T), np.float32)}
        if loss == "full":
            out["teacher_logprobs"] = np.zeros((B, T, self._vocab), np.float32)
        elif loss == "top_k":
            out["teacher_logprobs"] = np.zeros((B, T, k), np.float32)
            out["teacher_ids"] = np.zeros((B, T, k), np.int32)
        for g, group in enumerate(self.groups):
            rows = np.flatnonzero(np.isin(teacher_index, group))
            if not len(rows):
                continue
            # padding repeats a real row (an all-padding row has no key to attend to)
            take = np.concatenate([rows, np.full(self._bucket(len(rows)) - len(rows), rows[0])])
            sub = jax.tree.map(lambda x: x[take], host)
            sub = shard(sub, batch_shardings(sub, self.mesh, self.rules))
            ids = None
            if len(group) > 1:  # a bank: row b runs with its teacher's adapter
                ids = np.searchsorted(group, teacher_index[take]).astype(np.int32)
                ids = shard(ids, batch_shardings(ids, self.mesh, self.rules))
            scores = _to_host(self._call(self._graphdefs[g], self._params[g], sub, ids, **self.options))
            scores = {name: np.asarray(v)[:len(rows)] for name, v in scores.items()}
            for teacher in np.unique(teacher_index[rows]):
                mine = teacher_index[rows] == teacher
                _check_scores(self.names[teacher], rows[mine], {n: v[mine] for n, v in scores.items()},
                              host.response_mask[rows[mine]])
            for name, values in scores.items():
                out[name][rows] = values
        return out

    def close(self) -> None:
        self._params.clear()


class SGLangTeachers:
    """Teachers behind SGLang servers (one engine per teacher, see rollout_bridge), scoring the
    student's tokens with prompt log-probs (`max_new_tokens=0`). Every teacher that has rows in
    a batch is asked at once; the sampled-token loss is the only one they serve."""

    def __init__(self, names: Sequence[str], engines: Sequence[EngineThread]):
        self.names, self.engines = list(names), list(engines)

    def score(self, batch: RolloutBatch, teacher_index: np.ndarray) -> dict[str, np.ndarray]:
        tokens = np.asarray(batch.tokens)
        mask = np.asarray(batch.response_mask)
        lengths = np.asarray(batch.attention_mask).sum(axis=1)
        logp = np.zeros(tokens.shape, np.float32)
        asked = []
        for teacher in np.unique(teacher_index):
            rows = np.flatnonzero(teacher_index == teacher)
            engine = self.engines[teacher]
            sequences = [tokens[b, :lengths[b]].tolist() for b in rows]
            asked.append((teacher, rows, engine.score(sequences)))
        for teacher, rows, future in asked:
            try:
                scored = future.result()
            except EngineError as e:
                raise TeacherError(f"teacher {self.names[teacher]!r} could not score: {e}") from None
            for b, values in zip(rows, scored):
                logp[b, 1:lengths[b]] = values
        logp *= mask
        for teacher, rows, _ in asked:
            _check_scores(self.names[teacher], rows, {"logp_teacher": logp[rows]}, mask[rows])
        return {"logp_teacher": logp}

    def close(self) -> None:
        for engine in self.engines:
            engine.close()


def build_teachers(specs: Sequence[TeacherSpec], section: TeachersSection, student: Decoder, tokenizer: Tokenizer,
                   mesh: Mesh, opd: OPDConfig, temperature: float, log_dir: Path) -> Teachers:
    """The teachers of a merge, each checked before any training: its checkpoint loads, its
    vocabulary and tokenizer are the student's. Local ones are placed on the mesh; SGLang ones
    are launched (or reached at their URLs) and must answer."""
    if section.engine == "local":
        models = []
        for spec, (model, teacher_tokenizer) in zip(specs, load_local_teachers(specs, section.dtype)):
            check_teacher_compatible(spec.name, model.config.vocab_size, teacher_tokenizer, student.config.vocab_size,
                                     tokenizer)
            models.append(model)
        return LocalTeachers([s.name for s in specs], models, mesh, loss=opd.loss, top_k=opd.top_k,
                             temperature=temperature, microbatches=opd.update.microbatches)
    for spec in specs:
        config, teacher_tokenizer = load_teacher(spec.name, spec.path, section.dtype, weights=False)
        check_teacher_compatible(spec.name, config.vocab_size, teacher_tokenizer, student.config.vocab_size, tokenizer)
    engines: list[EngineThread] = []
    try:
        starts = []
        servers = section.sglang
        for spec in specs:
            if servers.launch is None and spec.name not in servers.urls:
                raise TeacherError(f"teacher {spec.name!r} has no entry in teachers.sglang.urls")
            engine = sglang_engine(servers, servers.urls.get(spec.name, ()), model_dir=spec.path.resolve(),
                                   log_dir=log_dir / spec.name, stream=False)
            engines.append(engine)
            starts.append((spec.name, engine.start()))
        for name, started in starts:  # the servers start side by side
            try:
                started.result()
            except EngineError as e:
                raise TeacherError(f"teacher {name!r}: {e}") from None
        return SGLangTeachers([s.name for s in specs], engines)
    except BaseException:
        for engine in engines:
            engine.close()
        raise
