"""Multi-turn episodes through any rollout engine: many at once, their turns batched.

Each episode alternates engine turns and environment steps until the environment ends it, or a
budget does (turns, tokens). Every turn is a request whose prompt is the whole trajectory so far
as token ids, so the engine continues exactly what it produced (token in, token out). Episodes
are asyncio tasks; a `TurnBatcher` gathers the turns waiting on the engine into one `stream`
call once every running episode is waiting, so the embedded engine generates them as one batch
and a server sees them together.

Faults stay in their episode: an environment that raises, returns something malformed or takes
longer than `timeout_s`, or a turn the engine failed after its retries, ends that episode as
"failed" with the reason, and the others go on. A turn aborted by a refit or pause is resumed
from what it had generated (its tokens keep their log-probs and weight version), never dropped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

from opd_jax.envs.codec import TurnCodec
from opd_jax.envs.protocol import EnvError, Environment, StepResult, Turn, check_result
from opd_jax.envs.trajectory import Trajectory
from opd_jax.models import Tokenizer
from rollout_bridge.protocol import Engine
from rollout_bridge.records import Completion, Failure, Request, SamplingParams


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 8  # model turns per episode
    max_tokens: int = 512  # prompt + every turn and observation
    turn_tokens: int = 32  # new tokens per model turn
    timeout_s: float = 30.0  # for each reset / step of the environment
    max_resumes: int = 4  # aborted turns resumed per episode before it is reported failed


class TurnBatcher:
    """One engine's turns from many episodes, sent as few `stream` calls as the episodes allow:
    a round's turns go out together once every running episode is waiting on the engine, sorted
    by their seeds. So batches are the same from run to run (what an exact resume needs), and a
    slow environment holds its round (up to its timeout). `expect(n)` counts n episodes as
    running before their tasks start, so episodes started together share their first round.

    An engine that batches continuously (`engine.batches_continuously`: the embedded engine with
    decode slots) gets each turn as soon as its episode sends it: the engine fits it into its
    running batch, and its numbers do not depend on when it arrived, so no round is needed."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._busy = 0  # episodes running (not waiting on the engine), or expected to start
        self._expected = 0
        self._waiting: list[tuple[Request, asyncio.Future]] = []

    def expect(self, n: int) -> None:
        self._busy += n
        self._expected += n

    def enter(self) -> None:
        if self._expected:
            self._expected -= 1
        else:
            self._busy += 1

    def leave(self) -> None:
        self._busy -= 1
        self._maybe_flush()

    def release(self, session: str) -> None:
        """The session (an episode) ended: an engine that keeps sessions' past (a prefix cache,
        a server per session) may let it go."""
        release = getattr(self.engine, "release", None)
        if release is not None:
            release([session])

    async def generate(self, request: Request) -> Completion:
        if getattr(self.engine, "batches_continuously", False):
            return await self._serve_one(request)
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((request, future))
        self._busy -= 1
        self._maybe_flush()
        try:
            return await future
        finally:
            self._busy += 1

    def _maybe_flush(self) -> None:
        if self._waiting and self._busy <= 0:
            batch = sorted(self._waiting, key=lambda w: (w[0].seed or 0, w[0].prompt_ids))
            self._waiting = []
            asyncio.get_running_loop().create_task(self._serve(batch))

    async def _serve_one(self, request: Request) -> Completion:
        got: Completion | None = None
        try:
            async for completion in self.engine.stream([request]):
                got = completion
        except Exception as e:  # the engine broke: this turn fails, the episode ends "failed"
            return Failure(request, f"{type(e).__name__}: {e}")
        return got if got is not None else Failure(request, "the engine returned no completion for this turn")

    async def _serve(self, batch: list[tuple[Request, asyncio.Future]]) -> None:
        futures = {r.request_id: f for r, f in batch}
        try:
            async for completion in self.engine.stream([r for r, _ in batch]):
                future = futures.pop(completion.request_id, None)
                if future is not None and not future.done():
                    future.set_result(completion)
        except Exception as e:  # the engine broke mid-batch: every turn still waiting gets a Failure
            for request, _ in batch:
                future = futures.pop(request.request_id, None)
                if future is not None and not future.done():
                    future.set_result(Failure(request, f"{type(e).__name__}: {e}"))
        for request, _ in batch:  # an engine that broke its protocol (a turn with no completion)
            future = futures.pop(request.request_id, None)
            if future is not None and not future.done():
                future.set_result(Failure(request, "the engine returned no completion for this turn"))


async def _call(fn: Callable[..., Any], *args: Any, timeout: float) -> Any:
    """An environment method, plain (in a worker thread) or async, within `timeout` seconds."""
    if inspect.iscoroutinefunction(fn):
        return await asyncio.wait_for(fn(*args), timeout)
    result = await asyncio.wait_for(asyncio.to_thread(fn, *args), timeout)
    if inspect.isawaitable(result):
        result = await asyncio.wait_for(result, timeout)
    return result


class _Fault(Exception):
    """Ends an episode as failed with this message."""


async def run_episode(make_env: Callable[[], Environment], *, batcher: TurnBatcher, codec: TurnCodec,
                      tokenizer: Tokenizer, sampling: SamplingParams, limits: EpisodeLimits, seed: int,
                      metadata: dict[str, Any]) -> Trajectory:
    """One episode of the environment `make_env()` builds; never raises for what the environment
    or the engine does: such an episode comes back with end "failed" and the reason."""
    prompt: list[int] = []
    batcher.enter()
    try:
        return await _episode(make_env, prompt, batcher, codec, tokenizer, sampling, limits, seed, metadata)
    except _Fault as e:
        return Trajectory.failed(tuple(prompt), str(e), metadata)
    finally:
        batcher.release(_session(seed))  # ended, failed or aborted: the engine may forget its past
        batcher.leave()


def _session(seed: int) -> str:
    """An episode's session (Request.session): its turns extend one another."""
    return f"episode-{seed}"


async def _environment(what: str, fn: Callable[..., Any], *args: Any, timeout: float) -> Any:
    try:
        return await _call(fn, *args, timeout=timeout)
    except TimeoutError:
        raise _Fault(f"the environment's {what} took longer than {timeout:g} s") from None
    except EnvError as e:
        raise _Fault(f"the environment's {what}: {e}") from None
    except Exception as e:  # the user's environment code: whatever it raises ends this episode
        raise _Fault(f"the environment's {what} raised {type(e).__name__}: {e}") from None


async def _episode(make_env, prompt: list[int], batcher: TurnBatcher, codec: TurnCodec, tokenizer: Tokenizer,
                   sampling: SamplingParams, limits: EpisodeLimits, seed: int, metadata: dict[str, Any]) -> Trajectory:
    env = await _environment("constructor", make_env, timeout=limits.timeout_s)
    observation = await _environment("reset", env.reset, timeout=limits.timeout_s)
    try:
        prompt.extend(codec.first(observation))
    except EnvError as e:
        raise _Fault(f"the first observation: {e}") from None
    ids: list[int] = []
    mask: list[int] = []
    logps: list[float] = []
    turn_ends: list[int] = []
    rewards: list[float] = []
    versions: list[int] = []
    finishes: list[str] = []
    routed = None
    end, success = "truncated", None
    for turn in range(limits.max_turns):
        room = limits.max_tokens - len(prompt) - len(ids)
        if room <= 0:
            break
        # one model turn, resumed where a refit or pause cut it
        out: list[int] = []
        out_logps: list[float] = []
        resumes = 0
        while True:
            params = dataclasses.replace(sampling, max_new_tokens=min(limits.turn_tokens, room) - len(out))
            request = Request(tuple(prompt + ids + out), params, metadata,
                              seed=(seed * 1_000_003 + turn * 101 + resumes) % 2**31, session=_session(seed))
            completion = await batcher.generate(request)
            if isinstance(completion, Failure):
                raise _Fault(f"turn {turn + 1}: the engine failed it after {completion.attempts} "
                             f"attempt(s): {completion.error}")
            out += completion.output_ids
            out_logps += completion.output_logprobs
            versions.append(completion.weight_version)
            routed, indexed = completion.routed_experts, completion.index_offsets
            if completion.finish_reason != "abort" or len(out) >= min(limits.turn_tokens, room):
                break
            resumes += 1
            if resumes > limits.max_resumes:
                raise _Fault(f"turn {turn + 1} was interrupted {resumes} times")
        finishes.append("abort" if resumes else completion.finish_reason)
        if not out:
            raise _Fault(f"turn {turn + 1}: the engine produced no tokens")
        ids += out
        mask += [1] * len(out)
        logps += out_logps
        turn_ends.append(len(ids) - 1)
        text = tokenizer.decode(out, skip_special_tokens=True)
        where = f"step (turn {turn + 1})"
        raw = await _environment(where, env.step, Turn(text, tuple(out), completion.finish_reason),
                                 timeout=limits.timeout_s)
        try:
            result: StepResult = check_result(raw)
        except EnvError as e:
            raise _Fault(f"the environment's {where}: {e}") from None
        rewards.append(float(result.reward))
        if "success" in result.info:
            success = bool(result.info["success"])
        if result.done or result.truncated:
            end = "done" if result.done else "truncated"
            break
        try:
            follow = codec.after_turn(out, result.observation)
        except EnvError as e:
            raise _Fault(f"the observation after turn {turn + 1}: {e}") from None
        if len(prompt) + len(ids) + len(follow) > limits.max_tokens:
            break  # out of tokens: truncated where the model's last turn ended
        ids += follow
        mask += [0] * len(follow)
        logps += [0.0] * len(follow)
    return Trajectory(prompt_ids=tuple(prompt), response_ids=tuple(ids), model_mask=tuple(mask),
                      logprobs=tuple(logps), turn_ends=tuple(turn_ends), turn_rewards=tuple(rewards), end=end,
                      weight_versions=tuple(versions), finish_reasons=tuple(finishes), metadata=metadata,
                      success=success, routed_experts=routed, index_offsets=indexed)


def demonstration(make_env: Callable[[], Environment], *, codec: TurnCodec, tokenizer: Tokenizer, end_of_turn: int,
                  limits: EpisodeLimits) -> tuple[list[int], list[int], list[int]]:
    """An episode played by the environment's own `expert()` (the supervised warm start imitates
    it): (prompt ids, response ids, loss mask), the mask 1 on the expert's turns and their stop
    tokens, built exactly as an engine's episode is. EnvError when the environment has no expert."""
    def call(value: Any) -> Any:
        return asyncio.run(value) if inspect.isawaitable(value) else value

    env = make_env()
    if not callable(getattr(env, "expert", None)):
        raise EnvError(f"{type(env).__name__} has no expert() to imitate; the warm start (sft.steps) needs one")
    prompt = codec.first(call(env.reset()))
    ids: list[int] = []
    mask: list[int] = []
    for _ in range(limits.max_turns):
        text = call(env.expert())
        turn = [*tokenizer.encode(text, add_special_tokens=False)[:limits.turn_tokens - 1], end_of_turn]
        ids += turn
        mask += [1] * len(turn)
        result = check_result(call(env.step(Turn(text, tuple(turn)))))
        if result.done or result.truncated:
            break
        follow = codec.after_turn(turn, result.observation)
        if len(prompt) + len(ids) + len(follow) > limits.max_tokens:
            break
        ids += follow
        mask += [0] * len(follow)
    return prompt, ids, mask
