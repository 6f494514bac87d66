"""`opd-jax generate`: plain text by default; with --json one JSON line per sample, logprobs
consistent with the model; bad input is one line."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from hf_reference import make_hf_model
from typer.testing import CliRunner

from opd_jax.cli import app
from opd_jax.models import load_model

runner = CliRunner()


def run(*args, json_lines=True):
    result = runner.invoke(app, ["generate", *map(str, args), *(["--json"] if json_lines else [])],
                           env={"COLUMNS": "1000"})
    return result, [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def test_generate_from_token_ids_on_a_saved_model(tmp_path):
    make_hf_model("qwen2", tmp_path)
    result, records = run(tmp_path, "--prompt-ids", "3,1,4,1,5", "-n", "3", "--max-new-tokens", "6",
                          "--temperature", "1.0", "--seed", "4")
    assert result.exit_code == 0, result.output
    assert [(r["request"], r["sample"]) for r in records] == [(0, 0), (0, 1), (0, 2)]
    model, _ = load_model(tmp_path)
    for r in records:
        assert r["prompt_token_ids"] == [3, 1, 4, 1, 5] and r["text"] is None
        seq = np.array(r["prompt_token_ids"] + r["token_ids"], np.int32)[None]
        logits = np.asarray(model(jnp.asarray(seq)))[0].astype(np.float64)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        expected = logp[4:-1][np.arange(len(r["token_ids"])), r["token_ids"]]
        np.testing.assert_allclose(r["logprobs"], expected, atol=1e-4)
    assert len({tuple(r["token_ids"]) for r in records}) > 1  # three independent samples


@pytest.mark.smollm2
def test_generate_chat_with_smollm2():
    result, records = run("smollm2-135m-instruct", "-p", "What is the capital of France?", "--temperature", "0",
                          "--max-new-tokens", "16")
    assert result.exit_code == 0, result.output
    (record,) = records
    assert "Paris" in record["text"] and record["finish_reason"] in ("stop", "length")
    assert len(record["token_ids"]) == len(record["logprobs"]) <= 16
    plain, _ = run("smollm2-135m-instruct", "-p", "What is the capital of France?", "--temperature", "0",
                   "--max-new-tokens", "16", json_lines=False)
    assert plain.exit_code == 0 and plain.stdout == record["text"] + "\n"  # the text alone, nothing else


def test_plain_text_and_chat_messages_on_a_model_without_a_chat_template(tmp_path):
    from flax import nnx

    from opd_jax.models import Decoder, ModelConfig, save_model
    from opd_jax.models.char_tokenizer import char_tokenizer
    tokenizer = char_tokenizer()
    config = ModelConfig(family="llama", vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
                         num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, eos_token_ids=(tokenizer.eos_token_id,))
    save_model(Decoder(config, rngs=nnx.Rngs(0)), tmp_path, tokenizer)
    result, _ = run(tmp_path, "--messages", '[{"role": "user", "content": "hi"}]', json_lines=False)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "has no chat template" in result.output and "--messages" in result.output
    result, _ = run(tmp_path, "-p", "1+1=", "-p", "2+2=", "--max-new-tokens", "3", "--temperature", "0",
                    json_lines=False)
    _, records = run(tmp_path, "-p", "1+1=", "-p", "2+2=", "--max-new-tokens", "3", "--temperature", "0")
    assert result.exit_code == 0
    expected = "".join(f"--- request {r['request']}, sample 0 ({r['finish_reason']}) ---\n{r['text']}\n" for r in records)
    assert result.stdout == expected


def test_bad_input_is_reported(tmp_path):
    result, _ = run(tmp_path / "missing", "--prompt-ids", "1")
    assert result.exit_code != 0 and "no such file or directory" in result.output
    make_hf_model("llama", tmp_path)
    result, _ = run(tmp_path, "--messages", "{not json")
    assert result.exit_code != 0 and "not valid JSON" in result.output
    result, _ = run(tmp_path, "-p", "hello")
    assert result.exit_code != 0 and "has no tokenizer" in result.output
    result, _ = run(tmp_path, "--prompt-ids", "1," * 200 + "1", "--max-new-tokens", "8")
    assert result.exit_code != 0 and "cache slots" in result.output
    # bytes that are not UTF-8 (the shell's $'3+4=\xff' reaches Python as a lone surrogate) and a
    # JSON-escaped lone surrogate: one line each, before the model is loaded
    result, _ = run(tmp_path, "-p", "3+4=\udcff")
    assert result.exit_code == 2 and "holds the byte 0xff, which is not UTF-8 at character 5" in result.output
    lines = tmp_path / "in.jsonl"
    lines.write_text('{"prompt": "ok"}\n{"prompt": "a\\ud800b"}\n')
    result, _ = run(tmp_path, "--input", lines)
    assert result.exit_code == 2 and "line 2: the prompt holds a lone surrogate \\ud800 at character 2" in result.output
    assert "Traceback" not in result.output
