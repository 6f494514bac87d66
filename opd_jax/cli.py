"""The `opd-jax` command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="GLM-5.2-style RL post-training in JAX: PPO + IcePop, SGLang rollouts, OPD merging.")


def _requests(prompt: list[str], messages: Optional[str], input_file: Optional[Path],
              prompt_ids: Optional[str]) -> list[dict[str, Any]]:
    requests: list[dict[str, Any]] = [{"prompt": p} for p in prompt]
    if messages is not None:
        try:
            parsed = json.loads(messages)
        except json.JSONDecodeError as e:
            raise typer.BadParameter(f"not valid JSON: {e}", param_hint="--messages") from None
        if not isinstance(parsed, list) or not all(isinstance(m, dict) and "role" in m for m in parsed):
            raise typer.BadParameter('expected a JSON list like [{"role": "user", "content": "..."}]',
                                     param_hint="--messages")
        requests.append({"messages": parsed})
    if prompt_ids is not None:
        try:
            requests.append({"prompt_ids": [int(t) for t in prompt_ids.split(",")]})
        except ValueError:
            raise typer.BadParameter("expected comma-separated integers", param_hint="--prompt-ids") from None
    if input_file is not None:
        for n, line in enumerate(input_file.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise typer.BadParameter(f"line {n}: not valid JSON ({e})", param_hint="--input") from None
            if not isinstance(record, dict) or not ({"prompt", "messages", "prompt_ids"} & record.keys()):
                raise typer.BadParameter(f"line {n}: needs a 'prompt', 'messages' or 'prompt_ids' field",
                                         param_hint="--input")
            requests.append(record)
    if not requests:
        raise typer.BadParameter("give --prompt, --messages, --prompt-ids or --input")
    return requests


@app.command()
def generate(
    model: Annotated[str, typer.Argument(help="HF model directory, .gguf file, or 'smollm2-135m-instruct'.")],
    prompt: Annotated[list[str], typer.Option("--prompt", "-p", help="A prompt (repeatable).")] = [],  # noqa: B006
    messages: Annotated[Optional[str], typer.Option(help="Chat messages as a JSON list.")] = None,
    prompt_ids: Annotated[Optional[str], typer.Option(help="A prompt as comma-separated token ids.")] = None,
    input_file: Annotated[Optional[Path], typer.Option("--input", exists=True, dir_okay=False,
                                                       help="JSON lines with prompt / messages / prompt_ids.")] = None,
    num_samples: Annotated[int, typer.Option("--num-samples", "-n", min=1, help="Samples per prompt.")] = 1,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 128,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy.")] = 0.7,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0)] = 1.0,
    top_k: Annotated[int, typer.Option(min=0, help="0 = off.")] = 0,
    stop_id: Annotated[list[int], typer.Option(help="Extra stop token id (repeatable); EOS always stops.")] = [],  # noqa: B006
    chat: Annotated[bool, typer.Option(help="Wrap plain prompts in the model's chat template.")] = True,
    seed: Annotated[int, typer.Option()] = 0,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "float32",
) -> None:
    """Sample from a model; one JSON line per sample: text, token ids, per-token logprobs."""
    import jax

    from opd_jax.models import load_model, resolve_model_path
    from opd_jax.sampling import Sampler, SamplingParams

    requests = _requests(prompt, messages, input_file, prompt_ids)
    try:
        decoder, tokenizer = load_model(resolve_model_path(model), dtype=dtype)
    except ValueError as e:  # ModelFormatError is one
        raise typer.BadParameter(str(e), param_hint="MODEL") from None
    stops = set(stop_id) | set(decoder.config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        stops.add(tokenizer.eos_token_id)
    ids = []
    for r in requests:
        if "prompt_ids" in r:
            ids.append(list(r["prompt_ids"]))
            continue
        if tokenizer is None:
            raise typer.BadParameter("this model has no tokenizer; give --prompt-ids", param_hint="MODEL")
        use_chat = "messages" in r or (chat and tokenizer.chat_template)
        conversation = r.get("messages") or [{"role": "user", "content": r["prompt"]}]
        ids.append(tokenizer.encode_chat(conversation) if use_chat else tokenizer.encode(r["prompt"]))
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            stop_token_ids=tuple(sorted(stops)))
    sampler = Sampler(decoder)
    batch = [p for p in ids for _ in range(num_samples)]
    try:
        rollouts = sampler.generate(batch, params, jax.random.key(seed))
    except ValueError as e:  # PromptTooLongError is one
        raise typer.BadParameter(str(e)) from None
    for i, rollout in enumerate(rollouts):
        record = {"request": i // num_samples, "sample": i % num_samples,
                  "text": tokenizer.decode(rollout.output_ids, skip_special_tokens=True) if tokenizer else None,
                  "token_ids": list(rollout.output_ids), "logprobs": list(rollout.output_logprobs),
                  "finish_reason": rollout.finish_reason, "prompt_token_ids": list(rollout.prompt_ids)}
        sys.stdout.write(json.dumps(record) + "\n")


def _split_overrides(config_file: Optional[Path], overrides: Optional[list[str]]):
    """`opd-jax train key=value ...` without a file: the first override lands in CONFIG."""
    overrides = list(overrides or [])
    if config_file is not None and "=" in str(config_file) and not config_file.exists():
        return None, [str(config_file), *overrides]
    return config_file, overrides


def _load(config_file: Optional[Path], overrides: list[str], schema: Any = None):
    from opd_jax.config import ConfigError, TrainConfig, load_config
    try:
        return load_config(config_file, overrides, schema=schema or TrainConfig)
    except ConfigError as e:
        raise typer.BadParameter(str(e), param_hint="CONFIG / OVERRIDES") from None


@app.command(context_settings={"allow_extra_args": False})
def train(
    config_file: Annotated[Optional[Path], typer.Argument(metavar="CONFIG", help="A YAML config (see configs/).")] = None,
    overrides: Annotated[Optional[list[str]], typer.Argument(metavar="KEY=VALUE...",
                                                             help="Dotted overrides, e.g. rollout.samples_per_prompt=8")] = None,
    resume: Annotated[bool, typer.Option(help="Continue the run in logging.run_dir from its last checkpoint.")] = False,
) -> None:
    """RL-train a policy (PPO with a critic + IcePop by default; see the config)."""
    from opd_jax.data import DataError
    from opd_jax.train import RunError
    from opd_jax.train import train as run

    config = _load(*_split_overrides(config_file, overrides))
    try:
        run_dir = run(config, resume=resume)
    except (RunError, DataError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"run written to {run_dir}")


@app.command()
def sft(
    config_file: Annotated[Optional[Path], typer.Argument(metavar="CONFIG", help="A YAML config (see configs/).")] = None,
    overrides: Annotated[Optional[list[str]], typer.Argument(metavar="KEY=VALUE...")] = None,
) -> None:
    """Supervised warm start only (the config's sft section); writes a Hugging Face directory."""
    from opd_jax.models import save_model
    from opd_jax.train.build import build_policy
    from opd_jax.train.sft import warm_start

    config = _load(*_split_overrides(config_file, overrides))
    if config.sft.steps == 0:
        raise typer.BadParameter("sft.steps is 0: nothing to train", param_hint="CONFIG / OVERRIDES")
    run_dir = Path(config.logging.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    policy, tokenizer = build_policy(config)
    policy = warm_start(policy, tokenizer, config, run_dir / "sft_metrics.jsonl")
    typer.echo(f"model written to {save_model(policy, run_dir / 'sft_policy', tokenizer)}")


@app.command()
def experts(
    config_file: Annotated[Path, typer.Argument(metavar="CONFIG", help="An experts config (see configs/).")],
    overrides: Annotated[Optional[list[str]], typer.Argument(metavar="KEY=VALUE...")] = None,
    only: Annotated[Optional[str], typer.Option(help="Run only 'base' or the expert of this name (one host each).")] = None,
) -> None:
    """Train the shared base, then one RL expert per domain from it (independent jobs)."""
    from opd_jax.config import ExpertsConfig
    from opd_jax.data import DataError
    from opd_jax.merge import ExpertsError, run_experts

    config = _load(config_file, list(overrides or []), ExpertsConfig)
    try:
        run_dir = run_experts(config, only=only)
    except (ExpertsError, DataError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"experts written to {run_dir}")


@app.command()
def merge(
    config_file: Annotated[Path, typer.Argument(metavar="CONFIG", help="A merge config (see configs/).")],
    overrides: Annotated[Optional[list[str]], typer.Argument(metavar="KEY=VALUE...")] = None,
    resume: Annotated[bool, typer.Option(help="Continue the merge in logging.run_dir from its last checkpoint.")] = False,
) -> None:
    """Merge the experts into one student by multi-teacher on-policy distillation; writes
    report.json (base, experts, student and weight-space baselines per domain)."""
    from opd_jax.config import MergeConfig
    from opd_jax.data import DataError
    from opd_jax.merge import MERGE_ERRORS, read_report_table
    from opd_jax.merge import merge as run

    config = _load(config_file, list(overrides or []), MergeConfig)
    try:
        run_dir = run(config, resume=resume)
    except (*MERGE_ERRORS, DataError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(read_report_table(run_dir))
    typer.echo(f"merge written to {run_dir}")


@app.callback()
def _root() -> None:
    """opd_jax command line."""


def main() -> None:
    app()


if __name__ == "__main__":
    main()
