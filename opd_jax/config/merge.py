"""The typed configs of the OPD merge pipeline: `opd-jax experts` (a shared base, then one RL
expert per domain) and `opd-jax merge` (the experts distilled into one student, plus the
weight-averaging baselines). Sections are the training config's own, so a knob means the same
thing in all three commands."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from opd_jax.config.schema import (
    CheckpointSection,
    DataSection,
    DType,
    LaunchSection,
    LoggingSection,
    ModelSection,
    RolloutSection,
    Section,
    SFTSection,
    SGLangOptions,
    SourceSpec,
    TrainConfig,
)
from opd_jax.core import OptimizerConfig
from opd_jax.core.opd_step import OPDConfig
from opd_jax.parallel import DistributedConfig, MeshConfig


class BaseSection(Section):
    """The model every expert starts from: `model` (fresh or a path), then `sft` supervised steps
    on the mix of every expert's prompts (0: the model as it is)."""

    model: ModelSection = ModelSection(fresh={})
    sft: SFTSection = SFTSection()


class JobsSection(Section):
    """How the experts are run. jobs = 1: one after another in this process. jobs > 1: that many
    at once, each in its own process (the base first); with devices_per_job set, job i sees
    devices [i·d, (i+1)·d) of this host through `device_env` (CUDA_VISIBLE_DEVICES on GPUs,
    TPU_VISIBLE_CHIPS on TPUs). On separate hosts run `opd-jax experts CONFIG --only NAME`."""

    jobs: int = Field(1, gt=0)
    devices_per_job: int | None = Field(None, gt=0)
    device_env: str = "CUDA_VISIBLE_DEVICES"


class ExpertsConfig(Section):
    """`opd-jax experts`: the base, then each expert trained by the RL loop on its own prompts.
    `expert` holds everything the expert runs share (steps, rollout, algorithm, an optional
    own-domain `sft` warm start, mesh, ...); its model, data.train and logging.run_dir are set
    per expert (the base; the expert's sources; run_dir/experts/NAME)."""

    run_dir: str = "runs/experts"
    base: BaseSection = BaseSection()
    expert: TrainConfig = TrainConfig()
    experts: dict[str, list[SourceSpec]] = Field(min_length=1)
    launch: JobsSection = JobsSection()

    @model_validator(mode="after")
    def _names(self) -> ExpertsConfig:
        for name, sources in self.experts.items():
            if not name or "/" in name or name == "base":
                raise ValueError(f"expert name {name!r} cannot name a directory (or is 'base')")
            if not sources:
                raise ValueError(f"expert {name!r} has no prompt sources")
        return self


class TeachersSection(Section):
    """The teachers, one per expert; a prompt goes to the teacher whose expert trained on its
    domain. `paths` (expert name → model) replaces the experts of `experts_dir`; then `domains`
    (expert name → the domains it covers) defaults to the expert's name. engine 'local': JAX
    models on the trainer's mesh (parameters sharded; each teacher scores only its own rows).
    engine 'sglang': one server group per teacher, `launch`ed here on its model or running at
    `urls[name]`; they score the student's tokens through the bridge (loss 'sampled' only)."""

    engine: Literal["local", "sglang"] = "local"
    paths: dict[str, str] = {}
    domains: dict[str, list[str]] = {}
    dtype: DType = "float32"
    launch: LaunchSection | None = None
    urls: dict[str, list[str]] = {}
    sglang: SGLangOptions = SGLangOptions()

    @model_validator(mode="after")
    def _engine_settings(self) -> TeachersSection:
        if self.engine == "sglang" and bool(self.urls) == (self.launch is not None):
            raise ValueError("teachers.engine 'sglang' needs exactly one of teachers.urls and teachers.launch")
        if self.engine == "local" and (self.urls or self.launch is not None):
            raise ValueError("teachers.urls / teachers.launch are for teachers.engine 'sglang'")
        unknown = sorted(set(self.domains) - set(self.paths)) if self.paths else []
        if unknown:
            raise ValueError(f"teachers.domains names teachers without a path: {', '.join(unknown)}")
        return self


class BaselinesSection(Section):
    """What the merged student is judged against: the experts' parameters averaged, and task
    arithmetic θ_base + λ·Σ_k (θ_k − θ_base) with λ picked from `task_arithmetic_scales` by the
    mean accuracy on validation prompts (drawn apart from the held-out ones)."""

    weight_average: bool = True
    task_arithmetic: bool = True
    task_arithmetic_scales: list[float] = Field([0.1, 0.2, 0.3, 0.5, 0.75, 1.0], min_length=1)
    validation_prompts_per_domain: int = Field(32, gt=0)


class MergeDataSection(DataSection):
    """The training data section, except that `train` defaults to the experts' own sources."""

    train: list[SourceSpec] = []


class MergeLoggingSection(LoggingSection):
    run_dir: str = "runs/merge"


class MergeConfig(Section):
    """`opd-jax merge`: the student (the experts' base unless `student` says otherwise) samples
    on the mix of the experts' prompts; each prompt's domain routes it to its teacher; the OPD
    step (`opd`) trains the student. `experts_dir` is an `opd-jax experts` run directory: its base,
    experts and prompt sources are the defaults for `student`, `teachers.paths` and `data.train`.
    `mix` (expert name → share) weights the experts' sources when data.train is not given."""

    experts_dir: str | None = None
    steps: int = Field(200, gt=0)
    seed: int = 0
    student: ModelSection | None = None
    teachers: TeachersSection = TeachersSection()
    mix: dict[str, float] = {}
    mesh: MeshConfig = MeshConfig()
    distributed: DistributedConfig = DistributedConfig()
    rollout: RolloutSection = RolloutSection()
    opd: OPDConfig = OPDConfig()
    optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-4)
    data: MergeDataSection = MergeDataSection()
    baselines: BaselinesSection = BaselinesSection()
    checkpoint: CheckpointSection = CheckpointSection()
    logging: MergeLoggingSection = MergeLoggingSection()

    @model_validator(mode="after")
    def _sources(self) -> MergeConfig:
        if self.experts_dir is None:
            if self.student is None or not self.teachers.paths:
                raise ValueError("without experts_dir, set student and teachers.paths")
            if not self.data.train:
                raise ValueError("without experts_dir, set data.train (the prompts to merge on)")
        if self.data.train and self.mix:
            raise ValueError("mix weights the experts' own sources; with data.train given, set each source's weight")
        if any(w <= 0 for w in self.mix.values()):
            raise ValueError("mix shares must be > 0")
        if self.teachers.engine == "sglang" and self.opd.loss != "sampled":
            raise ValueError(f"opd.loss {self.opd.loss!r} needs each teacher's whole distribution: use "
                             f"teachers.engine 'local', or opd.loss 'sampled' with SGLang teachers")
        if self.teachers.engine == "sglang" and self.rollout.temperature not in (0.0, 1.0):
            raise ValueError("SGLang teachers score at temperature 1 (prompt log-probs are not tempered): "
                             "set rollout.temperature to 1 (or 0, greedy)")
        return self
