"""`opd-jax mismatch`: every figure of mismatch.json is recomputed here with NumPy from the dumped
per-token log-probs (written from the formulas, not with the census's code), the intervals with
SciPy; an f32 engine against the f32 trainer agrees to float noise while a bf16 one does not;
a bad engine entry is one line naming it."""

import json

import numpy as np
import pytest
from scipy import stats
from test_cli_errors import assert_user_error, run_cli
from train_loop_settings import GLM5, TINY

SAMPLES, SEEDS = 12, (0, 1)
CLIP = (0.8, 1.28)
BANDS = ((0.5, 2.0), (0.5, 5.0), (0.8, 1.2))


@pytest.fixture(scope="module")
def census(tmp_path_factory):
    out = tmp_path_factory.mktemp("census")
    with pytest.MonkeyPatch.context() as patch:  # the trainer scores a row at a time, as it does long responses
        patch.setattr("opd_jax.mismatch.census._LOGITS_BYTES", 1)
        result = run_cli("mismatch", *TINY, "rollout.max_new_tokens=8", f"census.samples={SAMPLES}",
                         f"census.seeds=[{SEEDS[0]}, {SEEDS[1]}]", "census.position_bins=4",
                         "census.engines={f32: {}, bf16: {dtype: bfloat16}}", "--out", out, "--dump")
    assert result.exit_code == 0, result.output
    assert "census written to" in result.output
    return out, json.loads((out / "mismatch.json").read_text())


def by_hand(dump):
    """The seed's figures from its dump, straight from the formulas."""
    d = dump["trainer"].astype(np.float64) - dump["engine"].astype(np.float64)
    k = np.exp(d)
    out = {"tokens": d.size, "abs_dlogp": np.abs(d).mean(), "kl_k3": (k - 1 - d).mean(),
           "ratio q01": np.percentile(k, 1), "ratio q99": np.percentile(k, 99),
           "phantom clip": np.mean((k < CLIP[0]) | (k > CLIP[1]))}
    for lo, hi in BANDS:
        out[f"outside [{lo:g}, {hi:g}]"] = np.mean((k < lo) | (k > hi))
    sums, lengths = {}, {}
    for s, x in zip(dump["sequence"], d):
        sums[s] = sums.get(s, 0.0) + x
        lengths[s] = lengths.get(s, 0) + 1
    S, L = np.array([sums[s] for s in sorted(sums)]), np.array([lengths[s] for s in sorted(sums)], float)
    drift = 1000 * (np.abs(S) * L).sum() / (L * L).sum()
    p = np.exp(dump["trainer"].astype(np.float64))
    order = np.argsort(p, kind="stable")
    deciles = [np.abs(d[part]).mean() for part in np.array_split(order, 10)]
    return out, drift, deciles, len(sums)


@pytest.mark.parametrize("engine", ["f32", "bf16"])
def test_every_figure_is_recomputed_from_the_dump(census, engine):
    out, result = census
    entry = result["engines"][engine]
    per_seed = []
    for seed in SEEDS:
        dump = np.load(out / "tokens" / f"{engine}_seed{seed}.npz")
        # positions count each response's tokens from 0
        for s in np.unique(dump["sequence"]):
            np.testing.assert_array_equal(dump["position"][dump["sequence"] == s], np.arange((dump["sequence"] == s).sum()))
        figures, drift, deciles, sequences = by_hand(dump)
        got = entry["seeds"][str(seed)]
        assert sequences == SAMPLES == got["sequences"]["sequences"]
        for name, value in figures.items():
            np.testing.assert_allclose(got["tokens"][name], value, rtol=1e-6, atol=1e-12, err_msg=name)
        np.testing.assert_allclose(got["sequences"]["drift per 1k tokens"], drift, rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose([b["abs_dlogp"] for b in got["by_probability"]], deciles, rtol=1e-6, atol=1e-12)
        assert sum(b["tokens"] for b in got["by_position"]) == figures["tokens"]
        per_seed.append(figures["abs_dlogp"])
    summary = entry["summary"]["tokens"]["abs_dlogp"]
    low, high = stats.t.interval(0.95, len(per_seed) - 1, loc=np.mean(per_seed), scale=stats.sem(per_seed))
    np.testing.assert_allclose([summary["mean"], summary["low"], summary["high"]], [np.mean(per_seed), low, high],
                               rtol=1e-6, atol=1e-12)


def test_the_same_numerics_agree_and_bf16_does_not(census):
    out, result = census
    f32, bf16 = (result["engines"][e]["summary"]["tokens"]["abs_dlogp"]["mean"] for e in ("f32", "bf16"))
    assert f32 < 1e-5 < bf16, (f32, bf16)
    assert result["engines"]["f32"]["kind"] == "same code, same numerics"
    assert result["engines"]["bf16"]["kind"] == "same code, bfloat16"
    report = (out / "mismatch.md").read_text()
    assert "| bf16 | same code, bfloat16 |" in report and (out / "mismatch.png").stat().st_size > 0


def test_a_bad_engine_entry_is_one_line_naming_it():
    assert_user_error(run_cli("mismatch", *TINY, "census.engines={fp8: {dtyp: bfloat16}}"),
                      "census.engines.fp8.dtyp: unknown key (did you mean census.engines.fp8.dtype?)")
    assert_user_error(run_cli("mismatch", *TINY, "census.bands=[[2, 3]]"), "census.bands: [2.0, 3.0] must hold 1")
    assert_user_error(run_cli("mismatch", *TINY, "census.engines={bf16: {dtype: bfloat16}}", "--engines", "bf16,fp8"),
                      "--engines: fp8 not in census.engines (bf16)")
    assert_user_error(run_cli("mismatch", *TINY, "census.engines={bf16: {dtype: bfloat16}}", "--engines", "bf61"),
                      "--engines: bf61 not in census.engines (bf16); did you mean bf16?")
    # an engine that cannot serve the model is named before any engine samples (nothing measured is lost)
    late = run_cli("mismatch", *TINY, "rollout.max_new_tokens=4", "census.samples=4",
                   "census.engines={bf16: {dtype: bfloat16}, int4: {dtype: bfloat16, quantization: {kind: int4}}}")
    assert_user_error(late, "census.engines.int4.quantization.block_size: quantization block size 128 does not divide")
    assert "bf16 seed" not in late.output


def test_weight_noise_is_drawn_per_run_seed_and_weight_version():
    """rollout.inject_weight_noise's perturbation: the same for one (seed, version), another for
    another seed at the same step (seeds of a sweep are independent draws, not one direction)
    and for another version; its size is noise · std(w) per weight."""
    from flax import nnx
    from ppo_setup import tiny_models

    from opd_jax.train.build import EngineNumerics, engine_model

    policy, _ = tiny_models()
    params = nnx.state(policy, nnx.Param)
    clean = np.asarray(policy.backbone.embed.value)

    def moved(seed, version):
        model = engine_model(policy.config, params, EngineNumerics(), noise=0.5, seed=seed, version=version)
        return np.asarray(model.backbone.embed.value) - clean

    a = moved(0, 3)
    np.testing.assert_array_equal(a, moved(0, 3))
    for other in (moved(1, 3), moved(0, 4)):
        assert abs(np.corrcoef(a.ravel(), other.ravel())[0, 1]) < 0.2
    assert 0.4 < a.std() / clean.std() < 0.6


def test_a_one_seed_census_beside_its_run_writes_strict_json_and_replaces_an_earlier_dump(tmp_path):
    """One seed: intervals have no bounds, written as null (strict parsers reject NaN). The default
    report directory is beside the run, not inside it; a config whose model is fresh says it
    measures a random model; a later census without --dump leaves no earlier dump behind."""
    run = tmp_path / "run"
    args = [*TINY, "rollout.max_new_tokens=4", "census.samples=4", "census.seeds=[0]", f"logging.run_dir={run}"]
    first = run_cli("mismatch", *args, "--dump")
    assert first.exit_code == 0, first.output
    out = tmp_path / "run_mismatch"
    assert not run.exists() and (out / "tokens" / "engine_seed0.npz").exists()
    assert "note: measuring model.fresh, a randomly initialised model" in first.output

    def strict(constant):
        raise ValueError(f"not JSON: {constant}")
    result = json.loads((out / "mismatch.json").read_text(), parse_constant=strict)
    assert result["engines"]["engine"]["summary"]["tokens"]["abs_dlogp"]["low"] is None
    second = run_cli("mismatch", *args)
    assert second.exit_code == 0, second.output
    assert not (out / "tokens").exists() and (out / "mismatch.json").exists()


def test_the_census_measures_the_policy_its_run_trained(tmp_path):
    from opd_jax.config import load_config
    from opd_jax.mismatch import census_model

    config = load_config(None, [*TINY, f"logging.run_dir={tmp_path}"])
    (tmp_path / "hf_policy").mkdir()
    (tmp_path / "hf_policy" / "config.json").write_text("{}")
    measured, said = census_model(config)
    assert measured.model.path == str(tmp_path / "hf_policy") and measured.model.fresh is None
    assert said.startswith(f"measuring the policy the run trained, {tmp_path / 'hf_policy'}")


def test_a_glm5_census_counts_index_flips_and_the_mismatch_with_and_without_index_replay(tmp_path):
    """A bf16 engine against the f32 trainer on a GLM-5-shaped model: the census scores every
    token attending the trainer's own keys and the engine's (index replay). From the dump, NumPy
    recomputes the index-flip fraction (overall, per indexer layer, by position: the share of
    (token, indexer layer) pairs whose key sets differ) and |Δlogp| both ways; the report shows them."""
    out = tmp_path / "census"
    result = run_cli("mismatch", *TINY, *GLM5, "rollout.max_new_tokens=8", "census.samples=8", "census.seeds=[0]",
                     "census.position_bins=2", "census.engines={bf16: {dtype: bfloat16}}", "--out", out, "--dump")
    assert result.exit_code == 0, result.output
    assert "index flips" in result.output
    got = json.loads((out / "mismatch.json").read_text())["engines"]["bf16"]["seeds"]["0"]["index"]
    dump = np.load(out / "tokens" / "bf16_seed0.npz")
    own, engine = dump["index_own"], dump["index_engine"]
    assert own.shape == engine.shape == (dump["trainer"].size, 2, 4)
    flipped = np.array([[set(a) != set(b) for a, b in zip(x, y)] for x, y in zip(own, engine)])
    np.testing.assert_allclose(got["flip_frac"], flipped.mean(), rtol=1e-9)
    np.testing.assert_allclose(got["flip_frac per layer"], flipped.mean(0), rtol=1e-9)
    early = dump["position"] < 4  # positions 0-3 of 8: the first of the two position bins
    np.testing.assert_allclose(got["by_position"][0]["flip_frac"], flipped[early].mean(), rtol=1e-9)
    for keys, scored in (("own keys", dump["own_keys"]), ("engine's keys", dump["engine_keys"])):
        d = scored.astype(np.float64) - dump["engine"].astype(np.float64)
        np.testing.assert_allclose(got[keys]["abs_dlogp"], np.abs(d).mean(), rtol=1e-6)
    np.testing.assert_array_equal(dump["trainer"], dump["own_keys"])  # the config does not replay: its own keys
    assert "## DSA: the indexers' choices" in (out / "mismatch.md").read_text()
