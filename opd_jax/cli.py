"""The `opd-jax` command line."""

from __future__ import annotations

import enum
import errno
import functools
import json
import logging
import os
import shlex
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from opd_jax.errors import OpdJaxError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="GLM-5.2-style RL post-training in JAX: PPO + IcePop, SGLang rollouts, OPD merging.")
config_app = typer.Typer(no_args_is_help=True, help="Show a resolved config, or what a config key does.")
app.add_typer(config_app, name="config")
k8s_app = typer.Typer(no_args_is_help=True, help="Run on a Kubernetes cluster: JobSet + Kueue manifests for a config, "
                                                 "and the entrypoint of their pods.")
app.add_typer(k8s_app, name="k8s")

USER_ERROR = 2  # the exit status of a problem the user can fix (click's own usage errors use it too)
_debug = False
# set when a second Ctrl-C stopped a command: main() then ends the process at once, so that no
# writer thread of orbax or computation of XLA left running prints its own traceback (or aborts)
# while Python shuts down
_exit_at_once: int | None = None


def _speaks_plainly(command: Callable) -> Callable:
    """A project error (OpdJaxError: bad config, missing model, bad data, ...) becomes one
    `error: ...` message on stderr and exit status 2 (an interrupted run: `stopped: ...` and
    128 + the signal's number); with --debug, its traceback. A full disk and a second Ctrl-C are
    one line too. Anything else is a bug and keeps its traceback."""
    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except OpdJaxError as e:
            if _debug:  # the traceback, then the same line and status as without --debug
                traceback.print_exc()
            typer.echo(f"{getattr(e, 'prefix', 'error')}: {e}", err=True)
            _stop_at_once(e)
            raise typer.Exit(getattr(e, "exit_status", USER_ERROR)) from None
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            if _debug:
                traceback.print_exc()
            typer.echo(f"error: no space left on device writing {e.filename or 'a file'}; free some space (a run "
                       f"continues from its last checkpoint with --resume)", err=True)
            raise typer.Exit(USER_ERROR) from None
        except KeyboardInterrupt as e:
            if _debug:
                raise
            typer.echo(f"stopped: interrupted; {_again_hint()}", err=True)
            _stop_at_once(e)
            raise typer.Exit(130) from None
    return run


# what running an interrupted command again does, for those whose own runs do not say it
_AGAIN = {"sweep": "its finished runs are kept and interrupted ones resume",
          "mismatch": "the census starts over (nothing of this one is kept)"}


def _again_hint() -> str:
    """'run `opd-jax ...` again (what that does)' for the command line that was interrupted."""
    words = _command_words()
    what = _AGAIN.get(words[0], "") if words else ""
    return f"run `opd-jax {shlex.join(sys.argv[1:])}` again" + (f" ({what})" if what else "")


def _stop_at_once(error: BaseException) -> None:
    global _exit_at_once
    if isinstance(error, KeyboardInterrupt) or getattr(error, "at_once", False):
        _exit_at_once = getattr(error, "exit_status", 130)


def _command(target: typer.Typer = app, **options):
    def register(command: Callable) -> Callable:
        return target.command(**options)(_speaks_plainly(command))
    return register


class DType(enum.StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


def _checked_text(text: Any, hint: str, where: str = "") -> None:
    """BadParameter for text a tokenizer cannot take: bytes that were not UTF-8 (the shell's
    `$'\\xff'`, kept by Python as lone surrogates) or a lone surrogate from a JSON escape."""
    if not isinstance(text, str):
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        char = text[e.start]
        what = (f"the byte {ord(char) - 0xDC00:#04x}, which is not UTF-8" if 0xDC80 <= ord(char) <= 0xDCFF
                else f"a lone surrogate \\u{ord(char):04x}")
        raise typer.BadParameter(f"{where}holds {what} at character {e.start + 1}; give UTF-8 text",
                                 param_hint=hint) from None


def _requests(prompt: list[str], messages: Optional[str], input_file: Optional[Path],
              prompt_ids: Optional[str]) -> list[dict[str, Any]]:
    for p in prompt:
        _checked_text(p, "--prompt")
    requests: list[dict[str, Any]] = [{"prompt": p} for p in prompt]
    if messages is not None:
        try:
            parsed = json.loads(messages)
        except json.JSONDecodeError as e:
            raise typer.BadParameter(f"not valid JSON: {e}", param_hint="--messages") from None
        if not isinstance(parsed, list) or not all(isinstance(m, dict) and "role" in m for m in parsed):
            raise typer.BadParameter('expected a JSON list like [{"role": "user", "content": "..."}]',
                                     param_hint="--messages")
        for m in parsed:
            _checked_text(m.get("content"), "--messages")
        requests.append({"messages": parsed})
    if prompt_ids is not None:
        try:
            requests.append({"prompt_ids": [int(t) for t in prompt_ids.split(",")]})
        except ValueError:
            raise typer.BadParameter("expected comma-separated integers", param_hint="--prompt-ids") from None
    if input_file is not None:
        from opd_jax.data.sources import json_problem, utf8_line
        for n, raw in enumerate(input_file.read_bytes().splitlines(), start=1):
            try:
                line = utf8_line(raw, n)
            except ValueError as e:
                raise typer.BadParameter(f"line {n}: {e}", param_hint="--input") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise typer.BadParameter(f"line {n}: not valid JSON ({json_problem(e)})", param_hint="--input") from None
            if not isinstance(record, dict) or not ({"prompt", "messages", "prompt_ids"} & record.keys()):
                raise typer.BadParameter(f"line {n}: needs a 'prompt', 'messages' or 'prompt_ids' field",
                                         param_hint="--input")
            _checked_text(record.get("prompt"), "--input", f"line {n}: the prompt ")
            for m in record.get("messages") or []:
                _checked_text(m.get("content") if isinstance(m, dict) else None, "--input", f"line {n}: a message ")
            requests.append(record)
    if not requests:
        raise typer.BadParameter("give --prompt, --messages, --prompt-ids or --input")
    return requests


@_command()
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
    dtype: Annotated[DType, typer.Option(help="The weights' and computation's dtype.")] = DType.float32,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line per sample: text, token ids, logprobs.")] = False,
) -> None:
    """Sample from a model: the text of each sample (with --json, one JSON line per sample with
    its token ids, per-token logprobs and finish reason)."""
    import jax

    from opd_jax.models import load_model, resolve_model_path
    from opd_jax.sampling import Sampler, SamplingParams

    requests = _requests(prompt, messages, input_file, prompt_ids)
    decoder, tokenizer = load_model(resolve_model_path(model), dtype=dtype.value)
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
        if "messages" in r and not tokenizer.chat_template:
            raise typer.BadParameter(f"{model} has no chat template, so it cannot take chat messages; give a plain "
                                     f"--prompt instead", param_hint="--messages")
        use_chat = "messages" in r or (chat and tokenizer.chat_template)
        conversation = r.get("messages") or [{"role": "user", "content": r["prompt"]}]
        ids.append(tokenizer.encode_chat(conversation) if use_chat else tokenizer.encode(r["prompt"]))
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            stop_token_ids=tuple(sorted(stops)))
    sampler = Sampler(decoder)
    batch = [p for p in ids for _ in range(num_samples)]
    rollouts = sampler.generate(batch, params, jax.random.key(seed))
    for i, rollout in enumerate(rollouts):
        text = tokenizer.decode(rollout.output_ids, skip_special_tokens=True) if tokenizer else None
        if as_json:
            record = {"request": i // num_samples, "sample": i % num_samples, "text": text,
                      "token_ids": list(rollout.output_ids), "logprobs": list(rollout.output_logprobs),
                      "finish_reason": rollout.finish_reason, "prompt_token_ids": list(rollout.prompt_ids)}
            sys.stdout.write(json.dumps(record) + "\n")
            continue
        if len(rollouts) > 1:
            sys.stdout.write(f"--- request {i // num_samples}, sample {i % num_samples} "
                             f"({rollout.finish_reason}) ---\n")
        sys.stdout.write((text if text is not None else " ".join(map(str, rollout.output_ids))) + "\n")


def _split_overrides(config_file: Optional[Path], overrides: Optional[list[str]]):
    """`opd-jax train key=value ...` without a file: the first override lands in CONFIG."""
    overrides = list(overrides or [])
    if config_file is not None and "=" in str(config_file) and not config_file.exists():
        return None, [str(config_file), *overrides]
    return config_file, overrides


def _needs_config(command: str, config_file: Optional[Path], overrides: Optional[list[str]]) -> None:
    """A command that trains is never run on the defaults alone: they are no run anyone meant."""
    if config_file is None and not overrides:
        raise typer.BadParameter(f"give a config file (e.g. opd-jax {command} configs/quickstart.yaml) or KEY=VALUE "
                                 f"overrides; `opd-jax config show` prints every default", param_hint="CONFIG")


def _load(config_file: Optional[Path], overrides: list[str], schema: Any = None):
    from opd_jax.config import TrainConfig, load_config
    return load_config(config_file, overrides, schema=schema or TrainConfig)


@_command(context_settings={"allow_extra_args": False})
def train(
    config_file: Annotated[Optional[Path], typer.Argument(metavar="CONFIG", help="A YAML config (see configs/).")] = None,
    overrides: Annotated[Optional[list[str]], typer.Argument(metavar="KEY=VALUE...",
                                                             help="Dotted overrides, e.g. rollout.samples_per_prompt=8")] = None,
    resume: Annotated[bool, typer.Option(help="Continue the run in logging.run_dir from its last checkpoint.")] = False,
    force: Annotated[bool, typer.Option(help="With --resume: accept config changes a resume cannot honour.")] = False,
) -> None:
    """RL-train a policy (PPO with a critic + IcePop by default; see the config)."""
    from opd_jax.train import train as run

    _needs_config("train", config_file, overrides)
    config = _load(*_split_overrides(config_file, overrides))
    typer.echo(f"run written to {run(config, resume=resume, force=force)}")


@_command()
def sft(
    config_file: Annotated[Optional[Path], typer.Argument(metavar="CONFIG", help="A YAML config (see configs/).")] = None,
    overrides: Annotated[Optional[list[str]], typer.Argument(metavar="KEY=VALUE...")] = None,
    resume: Annotated[bool, typer.Option(help="Continue the run in logging.run_dir from its latest checkpoint.")] = False,
) -> None:
    """Supervised warm start only (the config's sft section); writes a Hugging Face directory."""
    from opd_jax.train.sft import run_sft

    _needs_config("sft", config_file, overrides)
    typer.echo(f"model written to {run_sft(_load(*_split_overrides(config_file, overrides)), resume=resume)}")


@_command()
def experts(
    config_file: Annotated[Path, typer.Argument(metavar="CONFIG", help="An experts config (see configs/).")],
    overrides: Annotated[Optional[list[str]], typer.Argument(metavar="KEY=VALUE...")] = None,
    only: Annotated[Optional[str], typer.Option(help="Run only 'base' or the expert of this name (one host each).")] = None,
) -> None:
    """Train the shared base, then one RL expert per domain from it (independent jobs)."""
    from opd_jax.config import ExpertsConfig
    from opd_jax.merge import run_experts

    config = _load(config_file, list(overrides or []), ExpertsConfig)
    typer.echo(f"experts written to {run_experts(config, only=only)}")


@_command()
def merge(
    config_file: Annotated[Path, typer.Argument(metavar="CONFIG", help="A merge config (see configs/).")],
    overrides: Annotated[Optional[list[str]], typer.Argument(metavar="KEY=VALUE...")] = None,
    resume: Annotated[bool, typer.Option(help="Continue the merge in logging.run_dir from its last checkpoint.")] = False,
    force: Annotated[bool, typer.Option(help="With --resume: accept config changes a resume cannot honour.")] = False,
) -> None:
    """Merge the experts into one student by multi-teacher on-policy distillation; writes
    report.json (base, experts, student and weight-space baselines per domain)."""
    from opd_jax.config import MergeConfig
    from opd_jax.merge import merge as run
    from opd_jax.merge import read_report_table

    config = _load(config_file, list(overrides or []), MergeConfig)
    run_dir = run(config, resume=resume, force=force)
    typer.echo(read_report_table(run_dir))
    typer.echo(f"merge written to {run_dir}")


@_command()
def recipe(
    config_file: Annotated[Path, typer.Argument(metavar="CONFIG", help="A recipe config (see configs/recipe.yaml).")],
    overrides: Annotated[Optional[list[str]], typer.Argument(metavar="KEY=VALUE...")] = None,
) -> None:
    """The whole OPD merge in one command: the base, one RL expert per domain, the merge, and
    report.md. Resumable: run it again after a kill and it finishes what is left."""
    from opd_jax.config import RecipeConfig
    from opd_jax.merge.recipe import run_recipe

    config = _load(config_file, list(overrides or []), RecipeConfig)
    typer.echo(f"recipe written to {run_recipe(config)}")


@_command()
def plan(
    config_file: Annotated[Optional[Path], typer.Argument(metavar="CONFIG", help="A training config (see configs/).")] = None,
    overrides: Annotated[Optional[list[str]], typer.Argument(metavar="KEY=VALUE...")] = None,
    devices: Annotated[int, typer.Option(help="Devices of the mesh to compile for (simulated).")] = 1,
    hbm: Annotated[Optional[float], typer.Option(help="Memory of one accelerator in GiB: exit 1 when the peak is over.")] = None,  # noqa: E501
    tokens: Annotated[Optional[int], typer.Option(help="Tokens per sequence (default: the longest of the first 64 training prompts + rollout.max_new_tokens).")] = None,  # noqa: E501
) -> None:
    """Compile each step of a training config ahead of time for N devices on abstract arrays (no
    weight is read) and print its per-device memory: weights, optimizer state, each program's
    arguments, outputs and temporaries, the peak, and with --hbm whether it fits."""
    from opd_jax.train.plan import plan_devices, plan_train, refusal

    _needs_config("plan", config_file, overrides)
    found = plan_devices(devices)  # before anything starts JAX: the simulated device count is read once
    result = plan_train(_load(*_split_overrides(config_file, overrides)), found, tokens)
    typer.echo(result.table(hbm))
    if hbm is not None and not result.fits(hbm):  # a finding, not a user error: exit 1, as a failed check
        typer.echo(f"error: {refusal(result, hbm, 'does not fit')}", err=True)
        raise typer.Exit(1)


@_command()
def mismatch(
    config_file: Annotated[Optional[Path], typer.Argument(metavar="CONFIG", help="A training config: its model, prompts and engine.")] = None,  # noqa: E501
    overrides: Annotated[Optional[list[str]], typer.Argument(metavar="KEY=VALUE...",
                                                             help="Dotted overrides, e.g. census.samples=64")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Where the report goes (default: logging.run_dir + _mismatch).")] = None,
    dump: Annotated[bool, typer.Option(help="Also write every token's log-probs (tokens/ENGINE_seedN.npz).")] = False,
    engines: Annotated[Optional[str], typer.Option(help="Only these of census.engines, comma-separated.")] = None,
) -> None:
    """Measure the rollout engine's mismatch with the trainer (the census section: engines side by
    side, samples, seeds, bands): mismatch.json, mismatch.md, mismatch.png."""
    from opd_jax.mismatch import aggregate, census_model, run_census, write_report

    _needs_config("mismatch", config_file, overrides)
    config = _load(*_split_overrides(config_file, overrides))
    run_dir = Path(config.logging.run_dir)
    where = out or run_dir.with_name(run_dir.name + "_mismatch")  # beside the run, never inside it
    config, said = census_model(config)
    if said:
        typer.echo(said, err=True)
    only = None if engines is None else [e.strip() for e in engines.split(",") if e.strip()]
    result = aggregate(run_census(config, where, dump=dump, only=only, echo=typer.echo))
    write_report(where, result)
    typer.echo((where / "mismatch.md").read_text())
    typer.echo(f"census written to {where}")


@_command()
def sweep(
    sweep_file: Annotated[Path, typer.Argument(metavar="SWEEP", help="A sweep file: base config, cells, seeds.")],
    jobs: Annotated[int, typer.Option(help="Runs at a time (each its own process).")] = 1,
    out: Annotated[Optional[Path], typer.Option(help="Where the runs and results go (default: the sweep's out).")] = None,
    aggregate_only: Annotated[bool, typer.Option(help="Only aggregate the runs that finished.")] = False,
    in_process: Annotated[bool, typer.Option(help="Run one run at a time in this process: quicker for many short "
                                             "runs (no start-up per run); a crash ends the sweep (run it again).")] = False,
) -> None:
    """Run every cell of a sweep with every seed (resuming what an earlier sweep left), then
    aggregate: sweep.json, sweep.md (means with confidence intervals, paired comparisons,
    collapse incidence) and curves.png."""
    from opd_jax.sweep import Sweep, run_sweep
    from opd_jax.sweep import aggregate_only as aggregate_existing

    loaded = Sweep(sweep_file, out)
    if aggregate_only:
        aggregate_existing(loaded)
    else:
        run_sweep(loaded, jobs, echo=typer.echo, in_process=in_process)
    typer.echo((loaded.out / "sweep.md").read_text())
    typer.echo(f"sweep written to {loaded.out}")


Kind = Annotated[str, typer.Option("--kind", help="Which command's config: train, experts, merge or recipe.")]


def _schema(kind: str) -> Any:
    from opd_jax.config.commands import schema_of
    return schema_of(kind)


@_command(config_app, name="show")
def config_show(
    config_file: Annotated[Optional[Path], typer.Argument(metavar="CONFIG", help="A YAML config (see configs/).")] = None,
    overrides: Annotated[Optional[list[str]], typer.Argument(metavar="KEY=VALUE...")] = None,
    kind: Kind = "train",
) -> None:
    """Print the resolved config (file + overrides + every default) as YAML."""
    from opd_jax.config import dump_config
    typer.echo(dump_config(_load(*_split_overrides(config_file, overrides), _schema(kind))), nl=False)


@_command(config_app, name="explain")
def config_explain(
    key: Annotated[str, typer.Argument(help="A dotted key, e.g. algorithm.ppo.surrogate.eps_high (or a section).")],
    kind: Kind = "train",
) -> None:
    """What a config key does, its type and its default (a section: each of its keys)."""
    from opd_jax.config import explain
    typer.echo(explain(_schema(kind), key))


def _k8s_config(config_file: Path, overrides: Optional[list[str]], kind: str) -> Any:
    """The config of `kind` (auto: from the file's top-level keys)."""
    import yaml

    from opd_jax.config.commands import schema_of
    from opd_jax.k8s import detect_kind
    if kind == "auto":
        try:
            data = yaml.safe_load(config_file.read_text()) if config_file.is_file() else {}
        except (OSError, yaml.YAMLError):
            data = {}  # load_config names the problem
        kind = detect_kind(data if isinstance(data, dict) else {}, str(config_file))
    return _load(config_file, list(overrides or []), schema_of(kind, on_cluster=True))


K8sKind = Annotated[str, typer.Option("--kind", help="Which command's config: auto (from its keys), train, merge, experts.")]


@_command(k8s_app, name="render")
def k8s_render(
    config_file: Annotated[Path, typer.Argument(metavar="CONFIG", help="A train, merge or experts config.")],
    overrides: Annotated[Optional[list[str]], typer.Argument(metavar="KEY=VALUE...")] = None,
    image: Annotated[Optional[str], typer.Option(help="The opd_jax image the pods run (required).")] = None,
    queue: Annotated[Optional[str], typer.Option(help="The Kueue LocalQueue to submit to (required).")] = None,
    kind: K8sKind = "auto",
    name: Annotated[Optional[str], typer.Option(help="Prefix of the objects' names (default: the run directory's).")] = None,
    namespace: Annotated[str, typer.Option()] = "default",
    priority: Annotated[Optional[str], typer.Option(help="Kueue WorkloadPriorityClass.")] = None,
    hosts: Annotated[int, typer.Option(help="Pods (processes) of the training job, and of each expert.")] = 1,
    accelerators: Annotated[int, typer.Option(help="Accelerators per pod (0: CPU only).")] = 0,
    accelerator_resource: Annotated[str, typer.Option(help="nvidia.com/gpu, google.com/tpu, ...")] = "nvidia.com/gpu",
    node_selector: Annotated[list[str], typer.Option(help="key=value (repeatable).")] = [],  # noqa: B006
    toleration: Annotated[list[str], typer.Option(help="key[=value][:Effect] (repeatable).")] = [],  # noqa: B006
    cpu: Annotated[Optional[str], typer.Option(help="CPU request per pod, e.g. 8.")] = None,
    memory: Annotated[Optional[str], typer.Option(help="Memory per pod, e.g. 64Gi.")] = None,
    volume_claim: Annotated[str, typer.Option(help="ReadWriteMany PVC holding the run directories.")] = "opd-jax-runs",
    mount_path: Annotated[str, typer.Option(help="Where the volume is mounted: every pod's working directory.")] = "/workspace",
    max_restarts: Annotated[int, typer.Option(help="JobSet restarts after a failure (each resumes).")] = 3,
    env: Annotated[list[str], typer.Option(help="KEY=VALUE for the opd_jax containers (repeatable).")] = [],  # noqa: B006
    service_account: Annotated[Optional[str], typer.Option(help="Every pod's service account.")] = None,
    image_pull_secret: Annotated[list[str], typer.Option(help="A Secret to pull the images with (repeatable).")] = [],  # noqa: B006
    server_image: Annotated[Optional[str], typer.Option(help="The SGLang servers' image (SGLang engine or teachers).")] = None,
    server_hosts: Annotated[int, typer.Option(help="Pods per SGLang server (LeaderWorkerSet size).")] = 1,
    server_accelerators: Annotated[Optional[int], typer.Option(help="Per server pod (default: --accelerators).")] = None,
    router: Annotated[bool, typer.Option(help="An sglang-router in front of the rollout servers.")] = True,
    router_image: Annotated[Optional[str], typer.Option(help="The router's image (default: --server-image).")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Write the manifests here (default: stdout).")] = None,
    check: Annotated[bool, typer.Option(help="Validate every manifest against its kind's schema.")] = False,
    hbm: Annotated[Optional[float], typer.Option(help="Memory of one accelerator in GiB: refuse a train config whose `opd-jax plan` on hosts × accelerators devices does not fit it.")] = None,  # noqa: E501
) -> None:
    """Kubernetes manifests (JobSet + Kueue, LeaderWorkerSet for SGLang servers, the config as a
    ConfigMap) for the run CONFIG describes, as one YAML stream for `kubectl apply -f`."""
    from opd_jax.k8s import ClusterSpec, K8sError, Toleration, parse_pairs, render
    from opd_jax.k8s.spec import to_label

    if not image:
        raise K8sError("--image is required: the opd_jax image the pods run")
    if not queue:
        raise K8sError("--queue is required: the Kueue LocalQueue the workloads are submitted to")
    if out is not None and (out.is_dir() or not out.parent.is_dir()):
        raise K8sError(f"--out {out}: " + ("is a directory; name a file" if out.is_dir() else
                                           f"its directory {out.parent} does not exist"))
    if hbm is not None:  # planned first: the simulated device count is read once, when JAX starts
        from opd_jax.train.plan import plan_devices, plan_train, refusal
        found = plan_devices(hosts * max(accelerators, 1))
    config = _k8s_config(config_file, overrides, kind)
    if hbm is not None:
        from opd_jax.config import TrainConfig
        if not isinstance(config, TrainConfig):
            raise K8sError("--hbm: opd-jax plan covers train configs (opd-jax train); leave --hbm out for this one")
        result = plan_train(config, found)
        if not result.fits(hbm):
            raise K8sError(refusal(result, hbm, f"--hbm {hbm:g}: {config_file} does not fit"))
    run_dir = config.run_dir if hasattr(config, "run_dir") else config.logging.run_dir
    spec = ClusterSpec(image=image, queue=queue, name=name or to_label(Path(run_dir).name) or "opd-jax",
                       namespace=namespace, priority_class=priority, hosts=hosts, accelerators=accelerators,
                       accelerator_resource=accelerator_resource, node_selector=parse_pairs(node_selector, "--node-selector"),
                       tolerations=tuple(Toleration.parse(t) for t in toleration), cpu=cpu, memory=memory,
                       volume_claim=volume_claim, mount_path=mount_path, max_restarts=max_restarts,
                       env=parse_pairs(env, "--env"), service_account=service_account,
                       image_pull_secrets=tuple(image_pull_secret),
                       server_image=server_image, server_hosts=server_hosts, server_accelerators=server_accelerators,
                       router=router, router_image=router_image)
    _write_manifests(render(config, spec), check, out)


def _write_manifests(manifests: list[dict[str, Any]], check: bool, out: Optional[Path]) -> None:
    """The manifests as one YAML stream to `out` (stdout when None), validated first with `check`."""
    from opd_jax.k8s import K8sError, dump_manifests, validate_manifests

    if check:
        problems = validate_manifests(manifests)
        if problems:
            raise K8sError("a rendered manifest does not validate: " + "; ".join(problems))
        typer.echo(f"{len(manifests)} manifests valid: "
                   f"{', '.join(m['kind'] + '/' + m['metadata']['name'] for m in manifests)}", err=True)
    text = dump_manifests(manifests)
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
        typer.echo(f"manifests written to {out}", err=True)


@_command(k8s_app, name="run")
def k8s_run(
    config_file: Annotated[Path, typer.Argument(metavar="CONFIG", help="The config the ConfigMap holds.")],
    kind: K8sKind = "auto",
    only: Annotated[Optional[str], typer.Option(help="experts: run only 'base' or this expert.")] = None,
) -> None:
    """A rendered pod's entrypoint: run the config's command, continuing from the last checkpoint
    when there is one (a JobSet restart), starting jax.distributed from the JobSet's environment."""
    from opd_jax.k8s import run_in_pod
    typer.echo(run_in_pod(_k8s_config(config_file, None, kind), only=only))


@app.callback()
def _root(debug: Annotated[bool, typer.Option("--debug", help="Show the traceback of an error, too.")] = False) -> None:
    """opd_jax command line."""
    global _debug
    _debug = debug
    if not debug:  # errors of orbax's coroutines, collected late (at exit), are never the user's to read
        sys.unraisablehook = lambda unraisable: None
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)


def main() -> None:
    """The `opd-jax` command: click's usage errors (a bad option value, a missing argument) are one
    `error: ...` line with exit status 2 here too, like every other user error."""
    try:
        status = app(standalone_mode=False)
    except typer.Abort:
        status = 130
    except typer.TyperException as e:  # click's exceptions, as typer vendors them
        message = e.format_message() if hasattr(e, "format_message") else str(e)
        words = _command_words()
        if "--debug" in sys.argv[1:] and words and sys.argv.index("--debug") > sys.argv.index(words[0]):
            message = f"--debug goes before the command: opd-jax --debug {' '.join(words)} ..."
        if message:  # none after the help that a bare group prints
            typer.echo(f"error: {message} (see: opd-jax {' '.join(words)} --help)".replace("  ", " "), err=True)
        status = getattr(e, "exit_code", USER_ERROR)
    finally:
        if _exit_at_once is not None:
            from opd_jax.train.signals import run_last

            run_last()  # e.g. a partial checkpoint that orbax's threads recreated is removed once more
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(_exit_at_once)
    sys.exit(status if isinstance(status, int) else 0)


def _command_words() -> list[str]:
    """The command named on the command line (`train`, `k8s render`), for the help hint."""
    words = []
    group: Any = typer.main.get_command(app)
    for arg in sys.argv[1:]:
        if arg.startswith("-"):
            continue
        command = getattr(group, "commands", {}).get(arg)
        if command is None:
            break
        words.append(arg)
        group = command
    return words


if __name__ == "__main__":
    main()
