"""`opd-jax merge` end to end at test size, with three teachers that differ (random tiny models
saved as Hugging Face directories): the merge sharded over 8 simulated devices equals the
unsharded merge (one device, in a process of its own); a killed and resumed merge ends where an
uninterrupted one does; each teacher scores only its own rows; bad inputs stop the merge with
a named error before any training."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
import tokenizers.models
from flax import nnx
from ppo_setup import assert_updates_close
from typer.testing import CliRunner
from xla_env import xla_flags

from opd_jax.cli import app
from opd_jax.config import MergeConfig, load_config, save_config
from opd_jax.core import RolloutBatch
from opd_jax.core.opd_step import teacher_scores
from opd_jax.merge import LocalTeachers, MergeError, RoutingError, TeacherError, merge, resolve_plan
from opd_jax.merge.teacher_samples import draw_pool, pool_rows
from opd_jax.models import Decoder, ModelConfig, load_model, save_model
from opd_jax.models.char_tokenizer import char_tokenizer
from opd_jax.parallel import MeshConfig, make_mesh
from opd_jax.train import checkpoint_steps
from opd_jax.train.batching import pad_rows

TOKENIZER = char_tokenizer()
CONFIG = ModelConfig(family="llama", vocab_size=TOKENIZER.vocab_size, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=2, num_kv_heads=2, head_dim=16, max_position_embeddings=128,
                     eos_token_ids=(TOKENIZER.eos_token_id,))
DOMAINS = ("addition", "max", "parity")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A student and one teacher per domain, every one of them different."""
    root = tmp_path_factory.mktemp("models")
    save_model(Decoder(CONFIG, rngs=nnx.Rngs(0)), root / "student", TOKENIZER)
    for seed, domain in enumerate(DOMAINS, start=1):
        save_model(Decoder(CONFIG, rngs=nnx.Rngs(seed)), root / domain, TOKENIZER)
    return root


def overrides(models: Path, run_dir: Path, *extra: str) -> list[str]:
    teachers = ", ".join(f"{d}: {models / d}" for d in DOMAINS)
    return [f"student.path={models / 'student'}", f"teachers.paths={{{teachers}}}",
            "data.train=[{builtin: addition, params: {digits: 1}}, {builtin: max, params: {hi: 9}}, "
            "{builtin: parity, params: {max_len: 5}}]",
            "steps=2", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "data.prompts_per_step=4",
            "data.eval_prompts_per_domain=8", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=4",
            "optimizer.learning_rate=1e-2", "logging.eval_every=2", "logging.progress_bar=false",
            "logging.tensorboard=false", "logging.plot=false", "checkpoint.every=1", "checkpoint.keep=3",
            "baselines.validation_prompts_per_domain=4", "baselines.task_arithmetic_scales=[0.5, 1.0]",
            f"logging.run_dir={run_dir}", *extra]


def config(models, run_dir, *extra) -> MergeConfig:
    return load_config(None, overrides(models, run_dir, *extra), schema=MergeConfig)


def student_params(run_dir: Path):
    model, _ = load_model(run_dir / "student")
    return jax.tree.leaves(nnx.state(model, nnx.Param))


TIMING = ("rollout/tokens_per_s", "rollout/wait_s", "rollout/refit_s")


def rows(run_dir: Path):
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def sharded_run(models, tmp_path_factory):
    """The merge on a (2, 2, 2) mesh, through the command line."""
    run_dir = tmp_path_factory.mktemp("sharded")
    result = CliRunner().invoke(app, ["merge", os.devnull, *overrides(models, run_dir)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "| **mean** |" in result.output  # the report table
    return run_dir


def test_sharded_merge_equals_the_unsharded_merge(models, sharded_run, tmp_path):
    single = tmp_path / "single"
    env = {**os.environ, "XLA_FLAGS": xla_flags(1), "JAX_PLATFORMS": "cpu",
           "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
    done = subprocess.run([sys.executable, "-m", "opd_jax.cli", "merge", os.devnull,
                           *overrides(models, single, "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1")],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = rows(sharded_run), rows(single)
    assert [r["step"] for r in a] == [0, 1, 2]
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            np.testing.assert_allclose(x[key], y[key], rtol=1e-4, atol=1e-5, err_msg=key)
    start = jax.tree.leaves(nnx.state(load_model(models / "student")[0], nnx.Param))
    assert_updates_close(student_params(sharded_run), student_params(single), start)
    # the merge moved the student, toward teachers that disagree with it
    assert max(np.abs(np.asarray(x) - np.asarray(y)).max() for x, y in zip(student_params(sharded_run), start)) > 1e-3
    # the batch's sampled reverse KL is positive; a domain's, from its few rows, may not be (an estimate)
    assert a[1]["opd/reverse_kl"] > 0 and any(a[1][f"opd/reverse_kl/{d}"] > 0 for d in DOMAINS if f"opd/reverse_kl/{d}" in a[1])


def test_report(sharded_run):
    report = json.loads((sharded_run / "report.json").read_text())
    assert set(report["domains"]) == set(DOMAINS)
    for row in report["domains"].values():
        assert set(row) == {"base", "expert", "student", "weight_average", "task_arithmetic"}
        assert all(0 <= v <= 1 for v in row.values())
    assert report["task_arithmetic_scale"] in (0.5, 1.0)
    assert {"merge/setup", "merge/teachers", "merge/first step (compiles)", "merge/steps", "merge/report: evaluation",
            "merge/report: baselines", "merge/export", "merge", "pipeline"} <= \
        set(report["wall_time_s"])
    assert report["teachers"]["max"]["domains"] == ["max"]
    assert (sharded_run / "report.md").read_text().startswith("| domain |")


def test_killed_and_resumed_merge_matches_an_uninterrupted_one(models, tmp_path):
    # top-k JSD for two teachers, forward KL for the third; domain balancing (its running
    # divergences resume with the checkpoint); a student grown deeper and wider than its base
    # divergence_by_teacher={max: forward_kl}; GKD's mixture (seed 3: steps 1 and 3 train on the
    # teachers' samples, the resumed step among them) after a warm-up on them
    extra = ("steps=3", "opd.loss=top_k", "opd.top_k=8", "opd.divergence=jsd", "divergence_by_teacher={max: forward_kl}",
             "balance.enabled=true", "balance.decay=0.5", "grow.num_layers=3", "grow.intermediate_size=80",
             "opd.reward_alpha=0.5", "baselines.weight_average=false", "baselines.task_arithmetic=false",
             "logging.eval_every=3", "seed=3", "teacher_samples.fraction=0.5", "teacher_samples.per_domain=4",
             "teacher_samples.correct_only=false", "teacher_samples.warmup.steps=2", "teacher_samples.warmup.batch_size=4")
    straight = merge(config(models, tmp_path / "straight", *extra))
    interrupted = config(models, tmp_path / "resumed", *extra)
    merge(interrupted, stop_after=2)
    with pytest.raises(Exception, match="already holds checkpoints .* pass --resume"):
        merge(interrupted)
    resumed = merge(interrupted, resume=True)
    assert rows(resumed) == rows(straight)
    assert [r["opd/pool_step"] for r in rows(straight)[1:]] == [1.0, 0.0, 1.0]
    assert [f"opd/reverse_kl/{d}" in r for r in rows(straight)[1:] for d in DOMAINS[:1]] == [False, True, False]
    weights = [{d: r[f"opd/balance_weight/{d}"] for d in DOMAINS} for r in rows(straight)[1:]]
    assert all(w == 1.0 for w in weights[0].values())  # nothing seen before the first step
    assert len({round(w, 6) for w in weights[2].values()}) > 1 and np.isclose(np.mean(list(weights[2].values())), 1.0)
    for x, y in zip(student_params(straight), student_params(resumed)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    report = json.loads((resumed / "report.json").read_text())
    assert "weight_average" not in report["domains"]["max"]
    assert (report["divergence"], report["balance"], report["grow"]["num_layers"], report["teacher_samples"]) == \
        ("jsd", True, 3, {"fraction": 0.5, "warmup_steps": 2})
    student, _ = load_model(resumed / "student")
    assert (student.config.num_layers, student.config.intermediate_size) == (3, 80)


def test_teachers_samples_are_the_teachers_own(models, tmp_path):
    """The pool: each row sampled by its domain's teacher (the engine's log-probs are that
    teacher's own, by a plain forward, and not another's), drawn again identically, written out
    for reading; the warm-up trains the student on it (its first loss is the base student's
    cross-entropy on the rows it drew, computed here); a teacher with no correct sample is named."""
    run_dir = tmp_path / "run"
    cfg = config(models, run_dir, "steps=1", "opd.loss=full",
                 "teacher_samples.per_domain=8", "teacher_samples.correct_only=false", "teacher_samples.warmup.steps=3",
                 "teacher_samples.warmup.batch_size=24", "teacher_samples.warmup.optimizer.learning_rate=0.05",
                 "baselines.weight_average=false", "baselines.task_arithmetic=false")
    plan = resolve_plan(cfg)
    student, tokenizer = load_model(models / "student")
    pool = draw_pool(cfg, plan, tokenizer, student)
    assert pool.drawn == pool.kept == {d: 8 for d in DOMAINS} and len(pool.trajectories) == 24
    batch, trajectories, index = pool.batch(np.arange(24), tokenizer.pad_token_id)
    assert [plan.teacher_names[k] for k in index] == [t.metadata["domain"] for t in trajectories]
    m = np.asarray(batch.response_mask)
    for k, name in enumerate(plan.teacher_names):
        teacher, _ = load_model(models / name)
        own = np.asarray(teacher_scores(*nnx.split(teacher, nnx.Param), batch, loss="sampled")["logp_teacher"])
        rows_k = index == k
        np.testing.assert_allclose(np.asarray(batch.logp_infer)[rows_k] * m[rows_k], own[rows_k], atol=2e-4)
        assert np.abs(np.asarray(batch.logp_infer)[~rows_k] * m[~rows_k] - own[~rows_k]).max() > 0.1
    again = draw_pool(cfg, plan, tokenizer, student)
    assert [t.response_ids for t in again.trajectories] == [t.response_ids for t in pool.trajectories]

    merge(cfg)
    written = [json.loads(line) for line in (run_dir / "teacher_samples.jsonl").read_text().splitlines()]
    assert [(w["teacher"], w["response"]) for w in written] == \
        [(plan.teacher_names[k], tokenizer.decode(list(t.response_ids))) for t, k in zip(pool.trajectories, index)]
    losses = [json.loads(line)["sft/loss"] for line in (run_dir / "warm_up" / "metrics.jsonl").read_text().splitlines()]
    first, _, _ = pool.batch(pool_rows(24, 24, cfg.seed, 0, warmup=True), tokenizer.pad_token_id)
    logp = np.asarray(teacher_scores(*nnx.split(student, nnx.Param), first, loss="sampled")["logp_teacher"])
    mask = np.asarray(first.response_mask)
    np.testing.assert_allclose(losses[0], -(logp * mask).sum() / mask.sum(), rtol=1e-4)
    # every step sees the whole pool (24 rows): the loss falls from the first step's
    assert len(losses) == 3 and losses[0] > max(losses[1], losses[2]), losses

    with pytest.raises(TeacherError, match="teacher 'addition' answered none of 8 addition prompts correctly"):
        draw_pool(config(models, run_dir, "teacher_samples.per_domain=8", "teacher_samples.fraction=0.5",
                         "opd.loss=full"), plan, tokenizer, student)


def ragged_batch(rows_: int, seed: int = 0) -> RolloutBatch:
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(3, CONFIG.vocab_size, int(rng.integers(2, 6)))) for _ in range(rows_)]
    responses = [list(rng.integers(3, CONFIG.vocab_size, int(rng.integers(1, 7)))) for _ in range(rows_)]
    tokens, attention, response = pad_rows(prompts, responses, pad_id=0, length=16)
    return RolloutBatch(tokens=tokens, attention_mask=attention, response_mask=response,
                        logp_infer=np.zeros(response.shape, np.float32), rewards=np.zeros(rows_, np.float32))


@pytest.mark.parametrize("loss", ["sampled", "top_k"])
def test_local_teachers_score_only_their_own_rows(models, loss):
    teachers = [load_model(models / d)[0] for d in DOMAINS]
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    local = LocalTeachers(list(DOMAINS), teachers, mesh, loss=loss, top_k=4, temperature=0.7)
    calls = []
    call = local._call
    local._call = lambda graphdef, params, batch, ids, **kw: calls.append(batch.tokens.shape[0]) or call(
        graphdef, params, batch, ids, **kw)
    batch = ragged_batch(7)
    index = np.asarray([2, 0, 2, 2, 0, 2, 2])  # teacher 1 ("max") has no rows here
    scores = local.score(batch, index)
    assert calls == [4, 8]  # 2 rows padded to 4 (the data-parallel shards), 5 rows to 8; "max" never ran
    for row, teacher in enumerate(index):
        one = jax.tree.map(lambda x: jnp.asarray(x[row:row + 1]), batch)
        alone = teacher_scores(*nnx.split(teachers[teacher], nnx.Param), one, loss=loss, top_k=4, temperature=0.7)
        for name, value in alone.items():
            np.testing.assert_allclose(scores[name][row], np.asarray(value[0]), atol=2e-5, err_msg=name)


def _swapped_tokenizer():
    vocab = TOKENIZER.backend.get_vocab()
    swapped = {**vocab, "1": vocab["2"], "2": vocab["1"]}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(swapped, unk_token="<unk>"))
    backend.pre_tokenizer, backend.decoder = TOKENIZER.backend.pre_tokenizer, TOKENIZER.backend.decoder
    return dataclasses.replace(TOKENIZER, backend=backend)


def test_bad_inputs_stop_the_merge_before_training(models, tmp_path):
    bad = tmp_path / "teachers"
    shutil.copytree(models / "max", bad / "truncated")
    weights = bad / "truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    save_model(Decoder(dataclasses.replace(CONFIG, vocab_size=CONFIG.vocab_size + 1), rngs=nnx.Rngs(0)),
               bad / "bigger_vocab", TOKENIZER)
    save_model(Decoder(CONFIG, rngs=nnx.Rngs(0)), bad / "other_tokenizer", _swapped_tokenizer())
    cases = {
        "truncated": (TeacherError, r"teacher 'max': the checkpoint at .*truncated will not load"),
        "bigger_vocab": (RoutingError, f"teacher 'max' has a vocabulary of {CONFIG.vocab_size + 1} tokens"),
        "other_tokenizer": (RoutingError, "teacher 'max' maps 2 of the student's tokens to other ids"),
    }
    for name, (error, message) in cases.items():
        run_dir = tmp_path / name
        cfg = config(models, run_dir, f"teachers.paths.max={bad / name}")
        with pytest.raises(error, match=message):
            merge(cfg)
        assert not (run_dir / "metrics.jsonl").exists() and not checkpoint_steps(run_dir)
    # a teacher whose scores are NaN stops the merge at its first step, before any update
    graphdef, weights = nnx.split(Decoder(CONFIG, rngs=nnx.Rngs(0)))
    save_model(nnx.merge(graphdef, jax.tree.map(lambda x: x * jnp.nan, weights)), bad / "nan", TOKENIZER)
    run_dir = tmp_path / "nan_teacher"
    with pytest.raises(TeacherError, match=r"teacher 'max' gave NaN or inf log-probabilities \(logp_teacher\) on "
                                           r"response tokens of sample\(s\)"):
        merge(config(models, run_dir, f"teachers.paths.max={bad / 'nan'}"))
    assert not checkpoint_steps(run_dir)
    # a prompt domain no teacher covers
    run_dir = tmp_path / "unrouted"
    cfg = config(models, run_dir, "data.train=[{builtin: max}, {builtin: sort}, {builtin: chain}]")
    with pytest.raises(RoutingError, match="no teacher for domain\\(s\\) chain, sort"):
        merge(cfg)
    assert not (run_dir / "metrics.jsonl").exists()
    # a divergence for a teacher the merge does not have
    run_dir = tmp_path / "divergence"
    with pytest.raises(MergeError, match=r"divergence_by_teacher names chess, which are not teachers \(addition, max, parity\)"):
        merge(config(models, run_dir, "opd.loss=full", "divergence_by_teacher={chess: forward_kl}"))
    assert not (run_dir / "metrics.jsonl").exists()
    # an experts directory whose expert never finished
    experts = tmp_path / "experts"
    (experts / "base").mkdir(parents=True)
    (experts / "base" / "base.json").write_text(json.dumps({"model": str(models / "student"), "eval": {},
                                                            "wall_time_s": 1.0}))
    (experts / "experts" / "max").mkdir(parents=True)
    cfg = load_config(None, [f"experts_dir={experts}", f"logging.run_dir={tmp_path / 'unfinished'}"],
                      schema=MergeConfig)
    with pytest.raises(MergeError, match=r"expert 'max' is not finished: .*expert.json is missing "
                                         r"\(run `opd-jax experts CONFIG --only max`\)"):
        merge(cfg)


def test_config_errors_name_the_problem(tmp_path):
    result = CliRunner().invoke(app, ["merge", os.devnull, "teachers.engine=sglang", "opd.loss=full",
                                      "teachers.sglang.urls={a: [http://127.0.0.1:1]}", "experts_dir=x"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "opd.loss 'full' needs each teacher's whole distribution" in result.output
    result = CliRunner().invoke(app, ["merge", os.devnull, "opd.los=full"], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "opd.los: unknown key" in result.output
    result = CliRunner().invoke(app, ["merge", os.devnull, "divergence_by_teacher={max: forward_kl}", "experts_dir=x"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "divergence_by_teacher needs the teachers' distributions" in result.output
    result = CliRunner().invoke(app, ["merge", os.devnull, "teacher_samples.fraction=0.5", "experts_dir=x"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "teacher_samples.fraction trains on the teachers' samples" in result.output
    result = CliRunner().invoke(app, ["merge", os.devnull, "teacher_samples.fraction=1.5", "experts_dir=x"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "teacher_samples.fraction" in result.output and "Traceback" not in result.output
    save_config(config(Path("m"), tmp_path), tmp_path / "merge.yaml")
    assert load_config(tmp_path / "merge.yaml", schema=MergeConfig) == config(Path("m"), tmp_path)


def test_plan_from_an_experts_run(tmp_path, models):
    """What a merge config resolves to: the base as the student, every finished expert as a
    teacher of its own domains, their prompt sources weighted by `mix`, and teachers from
    elsewhere beside them."""
    root = tmp_path / "experts"
    (root / "base").mkdir(parents=True)
    (root / "base" / "base.json").write_text(json.dumps({"model": str(models / "student"), "eval": {},
                                                         "wall_time_s": 1.0}))
    for name, sources in {"arith": [{"builtin": "addition"}, {"builtin": "multiplication", "weight": 3.0}],
                          "max": [{"builtin": "max"}]}.items():
        (root / "experts" / name).mkdir(parents=True)
        (root / "experts" / name / "expert.json").write_text(json.dumps({
            "name": name, "model": str(models / "max"), "domains": sorted(s["builtin"] for s in sources),
            "sources": sources, "wall_time_s": 2.0}))
    plan = resolve_plan(load_config(None, [f"experts_dir={root}", "mix={arith: 2.0}"], schema=MergeConfig))
    assert plan.student.path == str(models / "student")
    assert plan.teacher_names == ["arith", "max"]
    assert plan.routes == {"addition": 0, "multiplication": 0, "max": 1}
    # an expert's share is split over its sources by their own weights
    assert [(s.builtin, s.weight) for s in plan.data.train] == [("addition", 0.5), ("multiplication", 1.5),
                                                                ("max", 1.0)]
    # an outside teacher beside the run's experts needs the prompts it teaches
    extra = f"teachers.paths={{max: {models / 'max'}, parity: {models / 'parity'}}}"
    with pytest.raises(RoutingError, match="no teacher for domain\\(s\\) sort"):
        resolve_plan(load_config(None, [f"experts_dir={root}", extra,
                                        "data.train=[{builtin: parity}, {builtin: sort}]"], schema=MergeConfig))
    plan = resolve_plan(load_config(None, [f"experts_dir={root}", extra, "data.train=[{builtin: parity}, {builtin: max}]"],
                                    schema=MergeConfig))
    assert plan.routes == {"max": 0, "parity": 1} and set(plan.experts) == {"max"}
    with pytest.raises(MergeError, match="mix names chess, which are not teachers"):
        resolve_plan(load_config(None, [f"experts_dir={root}", "mix={chess: 1.0}"], schema=MergeConfig))
    # an expert that held out other problems (another data.seed) trained on some of the merge's
    summary = json.loads((root / "experts" / "max" / "expert.json").read_text())
    (root / "experts" / "max" / "expert.json").write_text(json.dumps({**summary, "held_out": {"seed": 3, "share": 0.25}}))
    assert resolve_plan(load_config(None, [f"experts_dir={root}", "data.seed=3"], schema=MergeConfig)).teacher_names
    with pytest.raises(MergeError, match=r"expert 'max' held out the problems of data.seed 3 at share 0.25, the merge "
                                         r"those of data.seed 0 at share 0.25: set the merge's data.seed"):
        resolve_plan(load_config(None, [f"experts_dir={root}"], schema=MergeConfig))


def test_lora_experts_share_one_base_and_score_as_their_merged_exports(models, tmp_path):
    """Three LoRA experts exported on one base (merged weights + adapter/ naming the base): the
    local teachers hold the base once and the three adapters as one bank, and score each row (all
    in one call, each with its expert's adapter) as the merged export of its expert does."""
    from opd_jax.merge.plan import TeacherSpec
    from opd_jax.merge.teachers import load_local_teachers
    from opd_jax.models import export_model
    from opd_jax.models.lora import LoraConfig

    base_dir = models / "student"
    for seed, domain in enumerate(DOMAINS, start=1):
        expert, _ = load_model(base_dir)
        expert.add_lora(LoraConfig(rank=2, alpha=4.0, targets=("q_proj", "v_proj", "down_proj")), nnx.Rngs(seed))
        for name, var in vars(expert.backbone.layers).items():
            if name.endswith("_lora_b"):  # trained adapters: non-zero B
                var[...] = 0.3 * jax.random.normal(jax.random.key(seed), var[...].shape)
        export_model(expert, tmp_path / domain, TOKENIZER, base_model=str(base_dir))
    specs = [TeacherSpec(name=d, path=tmp_path / d, domains=(d,)) for d in DOMAINS]
    adapted = [model for model, _ in load_local_teachers(specs, "float32")]
    assert all(m.config.lora is not None for m in adapted)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    shared = LocalTeachers(list(DOMAINS), adapted, mesh, loss="top_k", top_k=4, temperature=0.7)
    merged = LocalTeachers(list(DOMAINS), [load_model(tmp_path / d)[0] for d in DOMAINS], mesh, loss="top_k",
                           top_k=4, temperature=0.7)
    base_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(load_model(base_dir)[0], nnx.Param)))
    assert merged.nbytes == 3 * base_bytes
    assert base_bytes < shared.nbytes < 1.2 * base_bytes  # one base + three rank-2 adapters
    assert shared.groups == [[0, 1, 2]] and merged.groups == [[0], [1], [2]]  # a bank: the three in one call
    batch = ragged_batch(7)
    index = np.asarray([2, 0, 1, 2, 0, 1, 2])
    ours, reference = shared.score(batch, index), merged.score(batch, index)
    for name in reference:
        np.testing.assert_allclose(ours[name], reference[name], atol=2e-5, err_msg=name)


def test_a_lora_student_trains_its_adapters_on_a_frozen_base(models, tmp_path):
    """student.lora: the merge trains the student's adapters only; its export is the merged model
    and the adapter (PEFT's format) whose loading onto the base gives the merged model's logits."""
    from opd_jax.models.adapter_io import load_adapter

    run_dir = merge(config(models, tmp_path / "run", "student.lora={rank: 2, alpha: 4, targets: [q_proj, down_proj]}",
                           "baselines.weight_average=false", "baselines.task_arithmetic=false"))
    merged, _ = load_model(run_dir / "student")
    base, _ = load_model(models / "student")
    adapted = load_adapter(load_model(models / "student")[0], run_dir / "student" / "adapter")
    tokens = jnp.arange(1, 11, dtype=jnp.int32)[None]
    np.testing.assert_allclose(np.asarray(adapted(tokens)), np.asarray(merged(tokens)), atol=1e-4)
    assert np.abs(np.asarray(merged.backbone.layers.q[...]) - np.asarray(base.backbone.layers.q[...])).max() > 0
    for name in ("k", "v", "o", "gate", "up", "attn_norm"):  # frozen
        np.testing.assert_array_equal(np.asarray(getattr(merged.backbone.layers, name)[...]),
                                      np.asarray(getattr(base.backbone.layers, name)[...]))
    np.testing.assert_array_equal(np.asarray(merged.backbone.embed[...]), np.asarray(base.backbone.embed[...]))
