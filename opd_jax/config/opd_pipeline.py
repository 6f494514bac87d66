"""The typed configs of the OPD merge pipeline: `opd-jax experts` (a shared base, then one RL
expert per domain), `opd-jax merge` (the experts distilled into one student, plus the
weight-averaging baselines) and `opd-jax recipe` (both and the report, in one command).
Sections are the training config's own, so a knob means the same thing in every command."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from opd_jax.config.schema import (
    CheckpointSection,
    DataSection,
    Distributed,
    DType,
    LoggingSection,
    ModelSection,
    RolloutSection,
    Section,
    SFTSection,
    SGLangClientSection,
    SourceSpec,
    TrainConfig,
    check_server_source,
)
from opd_jax.core import OPDConfig, OptimizerConfig
from opd_jax.core.opd import Divergence
from opd_jax.parallel import DistributedConfig, MeshConfig


class BaseSection(Section):
    """The model every expert starts from: `model` (fresh or a path), then `sft` supervised steps
    on the mix of every expert's prompts (0: the model as it is)."""

    model: ModelSection = ModelSection(fresh={})
    """The base model."""
    sft: SFTSection = SFTSection()
    """Its supervised warm start on every expert's prompts."""


class JobsSection(Section):
    """How the experts are run. jobs = 1: one after another in this process. jobs > 1: that many
    at once, each in its own process (the base first). On separate hosts run `opd-jax experts
    CONFIG --only NAME`."""

    jobs: int = Field(1, gt=0)
    """Experts trained at once, each in its own process (1: one after another in this one)."""
    devices_per_job: int | None = Field(None, gt=0)
    """Devices each job sees: job i gets devices [i·d, (i+1)·d) through device_env; unset: all."""
    device_env: str = "CUDA_VISIBLE_DEVICES"
    """The variable that hands a job its devices (TPU_VISIBLE_CHIPS on TPUs)."""


def _check_named_sources(named: dict[str, list[SourceSpec]], kind: str) -> None:
    """Each name can be a directory of its own (an expert's), and has at least one prompt source."""
    for name, sources in named.items():
        if not name or "/" in name or name == "base":
            raise ValueError(f"{kind} name {name!r} cannot name a directory (or is 'base')")
        if not sources:
            raise ValueError(f"{kind} {name!r} has no data source: give it at least one (e.g. [{{builtin: addition}}])")


def _expert_model_is_the_base(data: Any) -> Any:
    """`expert.model` may hold only what the experts add to the base (lora, dtype): its path is set
    to the base per expert, so a section naming neither path nor fresh is completed here."""
    if not isinstance(data, dict) or not isinstance(data.get("expert"), dict):
        return data
    model = data["expert"].get("model")
    if isinstance(model, dict) and "path" not in model and "fresh" not in model:
        return {**data, "expert": {**data["expert"], "model": {**model, "fresh": {}}}}
    return data


class ExpertsConfig(Section):
    """`opd-jax experts`: the base, then each expert trained by the RL loop on its own prompts.
    `expert` holds everything the expert runs share (steps, rollout, algorithm, an optional
    own-domain `sft` warm start, mesh, ...); its model, data.train and logging.run_dir are set
    per expert (the base; the expert's sources; run_dir/experts/NAME)."""

    run_dir: str = "runs/experts"
    """Where the base and the experts go."""
    base: BaseSection = BaseSection()
    """The shared base."""
    expert: TrainConfig = TrainConfig()
    """The training config every expert shares (its model, data.train and run_dir are set per expert; expert.model.lora: each expert an adapter on the base)."""  # noqa: E501
    experts: dict[str, list[SourceSpec]] = Field(min_length=1)
    """Expert name → its prompt sources."""
    launch: JobsSection = JobsSection()
    """How the expert jobs are run."""

    @model_validator(mode="before")
    @classmethod
    def _expert_model(cls, data: Any) -> Any:
        return _expert_model_is_the_base(data)

    @model_validator(mode="after")
    def _names(self) -> ExpertsConfig:
        _check_named_sources(self.experts, "expert")
        return self


class TeacherServersSection(SGLangClientSection):
    """SGLang teachers: one server group per teacher, launched here on its model or running."""

    urls: dict[str, list[str]] = {}
    """Teacher name → its running servers (exclusive with launch)."""


class TeachersSection(Section):
    """The teachers, one per expert; a prompt goes to the teacher whose expert trained on its
    domain. engine 'local': JAX models on the trainer's mesh (parameters sharded; each teacher
    scores only its own rows). engine 'sglang': SGLang servers that score the student's tokens
    through the bridge (loss 'sampled' only)."""

    engine: Literal["local", "sglang"] = "local"
    """local: JAX models on the trainer's mesh; sglang: SGLang servers (see teachers.sglang)."""
    paths: dict[str, str] = {}
    """Expert name → model, replacing the experts of experts_dir."""
    domains: dict[str, list[str]] = {}
    """Expert name → the domains it covers (default: its name)."""
    dtype: DType = "float32"
    """Precision of local teachers."""
    sglang: TeacherServersSection = TeacherServersSection()
    """SGLang teacher servers (engine sglang only)."""

    @model_validator(mode="after")
    def _engine_settings(self) -> TeachersSection:
        check_server_source(self.sglang, self.engine == "sglang", "teachers.sglang", "teachers.engine")
        unknown = sorted(set(self.domains) - set(self.paths)) if self.paths else []
        if unknown:
            raise ValueError(f"teachers.domains names teachers without a path: {', '.join(unknown)}")
        return self


class BalanceSection(Section):
    """Domain balancing: each teacher's rows weigh in the distillation loss by how far the student
    still is from it. Per teacher, r = the moving average (decay) of its rows' sampled reverse
    KL over the steps that had them; weight = max(max(r, 0) / mean r, floor), the weights
    rescaled to mean 1 (`opd_jax.core.balance_weights`). Logged as opd/balance_weight/<teacher>."""

    enabled: bool = False
    """Weigh each teacher's rows by its running divergence (off: every row 1)."""
    floor: float = Field(0.25, gt=0, le=1)
    """The least weight (before the rescaling to mean 1) a teacher whose domain is learnt keeps."""
    decay: float = Field(0.9, ge=0, lt=1)
    """The moving average's decay per step with the teacher's rows (0: this step's value only)."""


class GrowSection(Section):
    """A student with more capacity than its base: grown from it before the merge so that it starts
    computing exactly the base's function (`opd_jax.models.grow`: added layers copy the layer below
    with their output projections zeroed; added MLP units copy existing ones, their down rows
    split). Dense students only."""

    num_layers: int | None = Field(None, gt=0)
    """The student's layers (unset: the base's)."""
    intermediate_size: int | None = Field(None, gt=0)
    """The student's MLP units per layer (unset: the base's)."""
    noise: float = Field(1e-3, ge=0)
    """Noise on the copied MLP units (× the weights' std), to break their symmetry (0: exact copies)."""


class TeacherSamplesSection(Section):
    """Samples of the teachers themselves: before the first step, each teacher answers
    `per_domain` training prompts of each of its domains (its own sampling stream, at the
    rollout's temperature and length), kept only where the verifier rewards them when
    `correct_only`. The pool serves GKD's mixture (`fraction`) and MOPD's supervised warm-up
    (`warmup`); it is written to RUN_DIR/teacher_samples.jsonl and drawn again identically on
    resume. Off (no pool) while fraction and warmup.steps are 0."""

    per_domain: int = Field(256, gt=0)
    """Prompts per domain each teacher answers (one sample each)."""
    correct_only: bool = True
    """Keep only the samples the domain's verifier rewards (> 0)."""
    fraction: float = Field(0.0, ge=0, le=1)
    """GKD's mixture (its 1 − λ): each step, with this probability, trains on a batch drawn from the
    pool instead of the student's own samples (0: on-policy only; 1: the teachers' samples only)."""
    warmup: SFTSection = SFTSection()
    """Supervised steps on the pool before the first OPD step (MOPD; steps 0: none). Cross-entropy
    on the teacher's response tokens; a run of its own in RUN_DIR/warm_up/ (checkpointed and resumed as every run)."""

    @property
    def enabled(self) -> bool:
        return self.fraction > 0 or self.warmup.steps > 0


class BaselinesSection(Section):
    """What the merged student is judged against: the experts' parameters averaged, and task
    arithmetic θ_base + λ·Σ_k (θ_k − θ_base) with λ picked by the mean accuracy on validation
    prompts (drawn apart from the held-out ones)."""

    weight_average: bool = True
    """Evaluate the experts' parameters averaged."""
    task_arithmetic: bool = True
    """Evaluate task arithmetic."""
    task_arithmetic_scales: list[float] = Field([0.1, 0.2, 0.3, 0.5, 0.75, 1.0], min_length=1)
    """The λ values task arithmetic chooses from."""
    validation_prompts_per_domain: int = Field(32, gt=0)
    """Prompts per domain that choose λ (apart from the held-out ones)."""


class MergeDataSection(DataSection):
    """The training data section, except that `train` defaults to the experts' own sources."""

    train: list[SourceSpec] = []
    """The prompt sources; empty: the experts' own, weighted by mix."""


class MergeLoggingSection(LoggingSection):
    run_dir: str = "runs/merge"
    """The merge's run directory: config, metrics, checkpoints, student/, report."""


class MergeConfig(Section):
    """`opd-jax merge`: the student (the experts' base unless `student` says otherwise) samples
    on the mix of the experts' prompts; each prompt's domain routes it to its teacher; the OPD
    step (`opd`) trains the student."""

    # what a resumed merge cannot change without --force: the student's shapes, its teachers, its prompts
    resume_fixed: ClassVar[tuple[str, ...]] = ("seed", "experts_dir", "student", "grow", "teachers.paths", "teachers.domains",
                                               "mix", "data.train", "data.seed", "data.held_out_share",
                                               "data.chat_template",
                                               "teacher_samples.per_domain", "teacher_samples.correct_only")

    experts_dir: str | None = None
    """An `opd-jax experts` run directory: its base, experts and sources are the defaults."""
    steps: int = Field(200, gt=0)
    """Training steps."""
    seed: int = 0
    """Seed of sampling."""
    student: ModelSection | None = None
    """The student's starting model; unset: the experts' base."""
    grow: GrowSection = GrowSection()
    """A larger student grown from that model (unset: the model as it is)."""
    teachers: TeachersSection = TeachersSection()
    """The teachers and how they score."""
    mix: dict[str, float] = {}
    """Expert name → its share of the prompt mix (when data.train is not given)."""
    mesh: MeshConfig = MeshConfig()
    """The device mesh."""
    distributed: Distributed = DistributedConfig()
    """Multi-host start-up (`distributed: auto`: from a JobSet pod's environment)."""
    rollout: RolloutSection = RolloutSection()
    """The student's rollout engine and sampling."""
    opd: OPDConfig = OPDConfig()
    """The OPD step."""
    divergence_by_teacher: dict[str, Divergence] = {}
    """Teacher (expert) name → the divergence its rows minimise, in place of opd.divergence (loss full / top_k)."""
    balance: BalanceSection = BalanceSection()
    """Domain balancing: teachers still far from the student weigh more."""
    teacher_samples: TeacherSamplesSection = TeacherSamplesSection()
    """The teachers' own samples: GKD's mixture and a supervised warm-up on them."""
    optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-4)
    """The student's optimizer."""
    data: MergeDataSection = MergeDataSection()
    """The prompts."""
    baselines: BaselinesSection = BaselinesSection()
    """The weight-space baselines in the report."""
    checkpoint: CheckpointSection = CheckpointSection()
    """Checkpoints."""
    logging: MergeLoggingSection = MergeLoggingSection()
    """The run directory, evaluation and logs."""

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
        if self.teacher_samples.fraction > 0 and self.opd.loss == "sampled":
            raise ValueError("teacher_samples.fraction trains on the teachers' samples, where the sampled loss (an on-policy "
                             "estimate) does not apply: set opd.loss to 'full' or 'top_k'")
        if self.teacher_samples.enabled and self.teachers.engine != "local":
            raise ValueError("teacher_samples needs local teachers (teachers.engine 'local'): they generate the samples")
        if self.divergence_by_teacher and self.opd.loss == "sampled":
            raise ValueError("divergence_by_teacher needs the teachers' distributions: set opd.loss to 'full' or 'top_k'")
        if self.teachers.engine == "sglang" and self.rollout.temperature not in (0.0, 1.0):
            raise ValueError("SGLang teachers score at temperature 1 (prompt log-probs are not tempered): "
                             "set rollout.temperature to 1 (or 0, greedy)")
        group = self.rollout.samples_per_prompt
        try:
            self.opd.check_batch_size(self.data.prompts_per_step * group, group)
        except ValueError as e:
            raise ValueError(f"data.prompts_per_step × rollout.samples_per_prompt: {e} (opd.update)") from None
        return self


class RecipeConfig(Section):
    """`opd-jax recipe`: the whole OPD merge in one resumable command, the domains named once:
    the shared base, one RL expert per domain (`base`, `expert`, `launch` as in `opd-jax
    experts`, into run_dir/experts), the merge (`merge` as in `opd-jax merge`, its experts_dir and
    logging.run_dir set to run_dir/experts and run_dir/merge), then run_dir/report.md."""

    run_dir: str = "runs/recipe"
    """Where everything goes: experts/, merge/, recipe.json, report.md, report.png."""
    domains: dict[str, list[SourceSpec]] = Field(min_length=1)
    """Domain name → its prompt sources: one expert per domain, the merge on all of them."""
    base: BaseSection = BaseSection()
    """The shared base."""
    expert: TrainConfig = TrainConfig()
    """The training config every expert shares (its model, data.train and run_dir are set per domain; expert.model.lora: each expert an adapter on the base)."""  # noqa: E501
    launch: JobsSection = JobsSection()
    """How the expert jobs are run."""
    merge: MergeConfig
    """The merge (experts_dir and logging.run_dir are the recipe's)."""

    @model_validator(mode="before")
    @classmethod
    def _merge_inside_run_dir(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = _expert_model_is_the_base(data)
        run_dir = str(data.get("run_dir", cls.model_fields["run_dir"].default))
        merge = dict(data.get("merge") or {})
        logging = dict(merge.get("logging") or {})
        fixed = {"merge.experts_dir": (merge.get("experts_dir"), f"{run_dir}/experts"),
                 "merge.logging.run_dir": (logging.get("run_dir"), f"{run_dir}/merge")}
        for key, (given, own) in fixed.items():
            if given is not None and str(given) != own:
                raise ValueError(f"{key} is the recipe's ({own}, from run_dir): leave it out")
        logging["run_dir"] = fixed["merge.logging.run_dir"][1]
        return {**data, "merge": {**merge, "experts_dir": fixed["merge.experts_dir"][1], "logging": logging}}

    @model_validator(mode="after")
    def _domains_named_once(self) -> RecipeConfig:
        _check_named_sources(self.domains, "domain")
        if self.merge.data.train or self.merge.teachers.paths:
            raise ValueError("the recipe's merge trains on its domains' experts: leave merge.data.train and "
                             "merge.teachers.paths out")
        unknown = sorted(set(self.merge.mix) - set(self.domains))
        if unknown:
            raise ValueError(f"merge.mix names {', '.join(unknown)}, which are not domains ({', '.join(self.domains)})")
        return self

    def experts_config(self) -> ExpertsConfig:
        """The `opd-jax experts` config of the recipe's first phase."""
        return ExpertsConfig(run_dir=f"{self.run_dir}/experts", base=self.base, expert=self.expert,
                             experts=self.domains, launch=self.launch)

    def merge_config(self) -> MergeConfig:
        """The `opd-jax merge` config of its second phase: the teachers are exactly the recipe's
        domains' experts (not whatever else the experts directory holds)."""
        paths = {d: str((Path(self.run_dir) / "experts" / "experts" / d / "hf_policy").resolve()) for d in self.domains}
        teachers = self.merge.teachers.model_copy(update={"paths": paths})
        return self.merge.model_copy(update={"teachers": teachers})
