"""An async client of SGLang's native API behind the engine protocol: one or more servers (or one
sglang-router URL), least-outstanding dispatch, streaming or not, retries with backoff, abort,
pause/continue, and weight refit.

Every request ends as exactly one Completion. Connection errors, timeouts, 5xx/503, a cut stream
and malformed JSON are retried (on the least-loaded server, with exponential backoff) up to
`max_retries` times, then reported as a Failure; a 4xx or a server-side error message is a
Failure at once. A request interrupted by a refit (SGLang's pause_generation aborts what is in
flight) is resumed from the tokens it already has, or started again, as `interrupted` says; a
resumed rollout's tokens span two weight versions and its metadata lists them.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import os
import random
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Literal

import httpx

from rollout_bridge import sglang_api as api
from rollout_bridge.protocol import TEMPERED_UNTRUNCATED, UNTEMPERED_UNTRUNCATED, EngineError, WeightUpdate
from rollout_bridge.records import Completion, Failure, Request, Rollout
from rollout_bridge.servers import ServerGroup

RefitMode = Literal["auto", "disk", "restart"]


class _Retryable(Exception):
    pass


@dataclasses.dataclass
class _Flight:
    request: Request
    url: str | None = None
    rid: str | None = None
    aborted: bool = False
    partial: api.Output | None = None


_SESSIONS = 65536  # sessions whose server is remembered (the least recently used forgotten)


@dataclasses.dataclass
class EngineStats:
    retries: int = 0
    interrupted: int = 0
    failures: int = 0
    refits: int = 0
    refit_s: float = 0.0
    prompt_tokens: int = 0  # of the answered requests whose server reported it (meta_info.prompt_tokens)
    cached_tokens: int = 0  # of them, found in the server's radix cache (meta_info.cached_tokens)


class SGLangEngine:
    def __init__(self, urls: Sequence[str] = (), *, servers: ServerGroup | None = None, stream: bool = True,
                 request_timeout_s: float = 300.0, connect_timeout_s: float = 10.0, max_retries: int = 5,
                 backoff_s: float = 0.2, max_backoff_s: float = 5.0, max_concurrency: int = 256,
                 refit: RefitMode = "auto", refit_dir: str | Path = "refit",
                 interrupted: Literal["resume", "discard"] = "resume", weight_version: int = 0,
                 routing: api.RoutingLayout | None = None, stream_interval: int = 1, wait_for_servers_s: float = 0.0):
        self.urls = list(urls) or (servers.urls if servers else [])
        if not self.urls:
            raise EngineError("SGLangEngine needs server URLs or a ServerGroup to launch")
        if refit == "restart" and servers is None:
            raise EngineError("refit='restart' needs servers the bridge launched itself (rollout.sglang.launch)")
        self.servers, self.stream_responses, self.stream_interval = servers, stream, stream_interval
        self.max_retries, self.backoff_s, self.max_backoff_s = max_retries, backoff_s, max_backoff_s
        self.refit, self.refit_dir, self.interrupted = refit, Path(refit_dir), interrupted
        self._timeout = httpx.Timeout(request_timeout_s, connect=connect_timeout_s)
        self.wait_for_servers_s = wait_for_servers_s
        self._max_concurrency = max_concurrency
        self._client: httpx.AsyncClient | None = None
        self._slots: asyncio.Semaphore | None = None
        self._running: asyncio.Event | None = None
        self._load = {url: 0 for url in self.urls}
        self._sessions: collections.OrderedDict[str, str] = collections.OrderedDict()  # session -> its server
        self._flights: dict[str, _Flight] = {}
        self._pause_epoch = 0
        self._version = weight_version
        self.stats = EngineStats()
        self._launched = False
        self.routing = routing  # a MoE policy's layout: ask for every token's experts (routing replay)
        # SGLang reports log_softmax(logits / T) before top-k/top-p, unless a server it launched is
        # told to report the untempered log-probs; servers someone else runs are taken as default
        env = {**os.environ, **dict(servers.spec.env)} if servers else {}
        original = env.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "")
        self.logprob_convention = UNTEMPERED_UNTRUNCATED if original.lower() in ("1", "true", "yes") else \
            TEMPERED_UNTRUNCATED

    @property
    def weight_version(self) -> int:
        return self._version

    # ------------------------------------------------------------------ plumbing
    def _ensure(self) -> httpx.AsyncClient:
        """Created lazily, inside the event loop that uses them."""
        if self._client is None:
            limits = httpx.Limits(max_connections=self._max_concurrency + 16,
                                  max_keepalive_connections=self._max_concurrency + 16)
            self._client = httpx.AsyncClient(timeout=self._timeout, limits=limits)
            self._slots = asyncio.Semaphore(self._max_concurrency)
            self._running = asyncio.Event()
            self._running.set()
        return self._client

    def _pick(self, session: str | None = None) -> str:
        """The server of the request's session while it is up (its radix cache holds the
        session's past), else the least loaded one (which the session then keeps)."""
        up = [u for u in self.urls if self.servers is None or self.servers.is_up(u)] or self.urls
        kept = self._sessions.get(session) if session is not None else None
        if kept in up:
            self._sessions.move_to_end(session)
            return kept
        url = min(up, key=lambda u: self._load[u])
        if session is not None:
            self._sessions[session] = url
            if len(self._sessions) > _SESSIONS:
                self._sessions.popitem(last=False)
        return url

    def release(self, sessions: Sequence[str]) -> None:
        """These sessions (episodes) ended: their servers are no longer theirs."""
        for session in sessions:
            self._sessions.pop(session, None)

    def _backoff(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)) * (0.5 + random.random() / 2)

    async def _call(self, url: str, path: str, body: dict | None = None, method: str = "POST") -> httpx.Response:
        return await self._ensure().request(method, url + path, json=body)

    # ------------------------------------------------------------------ generation
    async def _attempt(self, flight: _Flight, url: str, body: dict) -> api.Output:
        client = self._ensure()
        try:
            if not self.stream_responses:
                response = await client.post(url + "/generate", json=body)
                self._check_status(url, response.status_code, response.text)
                try:
                    payload = response.json()
                except json.JSONDecodeError as e:
                    raise _Retryable(f"{url}: response is not JSON ({e})") from None
                return api.parse_output(payload)
            so_far = None
            async with client.stream("POST", url + "/generate", json=body) as response:
                if response.status_code != 200:
                    self._check_status(url, response.status_code, (await response.aread()).decode(errors="replace"))
                async for line in response.aiter_lines():
                    event = api.sse_data(line)
                    if event is None:
                        continue
                    if event is api.DONE:
                        break
                    so_far = api.merge_stream(so_far, api.parse_output(event))
                    flight.partial = so_far
            if so_far is None or so_far.finish_reason is None:
                raise _Retryable(f"{url}: the stream ended before the request finished")
            return so_far
        except httpx.TransportError as e:
            raise _Retryable(f"{url}: {type(e).__name__}: {e}") from None
        except api.ServerRejected:
            raise
        except api.ProtocolError as e:
            raise _Retryable(f"{url}: {e}") from None

    @staticmethod
    def _check_status(url: str, status: int, text: str) -> None:
        if status >= 500 or status in (408, 429):
            raise _Retryable(f"{url}: HTTP {status}: {text[:200]}")
        if status != 200:
            raise api.ServerRejected(f"{url}: HTTP {status}: {text[:300]}")

    async def _generate_one(self, request: Request) -> Completion:
        self._ensure()
        flight = _Flight(request)
        self._flights[request.request_id] = flight
        began = time.perf_counter()
        prefix_ids: tuple[int, ...] = ()
        prefix_logprobs: tuple[float, ...] = ()
        versions: list[int] = []
        attempts = 0
        try:
            async with self._slots:
                while True:
                    await self._running.wait()
                    if flight.aborted:
                        return self._rollout(request, prefix_ids, prefix_logprobs, "abort", versions, began)
                    if len(prefix_ids) >= request.params.max_new_tokens:
                        return self._rollout(request, prefix_ids, prefix_logprobs, "length", versions, began)
                    url, epoch, version = self._pick(request.session), self._pause_epoch, self._version
                    flight.url, flight.rid, flight.partial = url, f"{request.request_id}-{attempts}", None
                    attempts += 1
                    self._load[url] += 1
                    try:
                        out = await self._attempt(flight, url, api.generate_body(
                            request, flight.rid, stream=self.stream_responses, prefix=prefix_ids,
                            routed_experts=self.routing is not None, stream_interval=self.stream_interval))
                    except _Retryable as e:
                        interrupted = self._pause_epoch != epoch
                        if flight.partial is not None and flight.partial.output_ids and self.interrupted == "resume":
                            prefix_ids += flight.partial.output_ids
                            prefix_logprobs += flight.partial.logprobs
                            versions.append(version)
                        if interrupted:  # a restart-refit cut the connection: not the request's fault
                            self.stats.interrupted += 1
                            attempts -= 1
                            continue
                        failure = await self._retry_or_fail(request, str(e), attempts)
                        if failure is not None:
                            return failure
                        continue
                    except api.ServerRejected as e:
                        self.stats.failures += 1
                        return Failure(request, str(e), attempts)
                    finally:
                        self._load[url] -= 1
                    served = int(out.weight_version) if out.weight_version not in (None, "") and \
                        out.weight_version.isdigit() else version
                    if out.prompt_tokens is not None and out.cached_tokens is not None:
                        self.stats.prompt_tokens += out.prompt_tokens
                        self.stats.cached_tokens += out.cached_tokens
                    if out.finish_reason != "abort" or flight.aborted:
                        rollout = self._rollout(request, prefix_ids + out.output_ids, prefix_logprobs + out.logprobs,
                                                out.finish_reason if not flight.aborted else "abort",
                                                [*versions, served], began)
                        return self._with_routing(request, rollout, out, attempts)
                    if self._pause_epoch != epoch or not self._running.is_set():
                        self.stats.interrupted += 1
                        attempts -= 1
                        if self.interrupted == "resume" and out.output_ids:
                            prefix_ids += out.output_ids
                            prefix_logprobs += out.logprobs
                            versions.append(served)
                        elif self.interrupted == "discard":
                            prefix_ids, prefix_logprobs, versions = (), (), []
                        continue
                    # an abort nobody asked for (the server shed the request): try again
                    failure = await self._retry_or_fail(request, f"{url}: aborted by the server: {out.abort_message}",
                                                        attempts)
                    if failure is not None:
                        return failure
        finally:
            del self._flights[request.request_id]

    async def _retry_or_fail(self, request: Request, error: str, attempts: int) -> Failure | None:
        """After a failed attempt: back off and return None (try again), or give up."""
        if attempts > self.max_retries:
            self.stats.failures += 1
            return Failure(request, f"{error} (gave up after {attempts} attempts)", attempts)
        self.stats.retries += 1
        await asyncio.sleep(self._backoff(attempts))
        return None

    def _with_routing(self, request: Request, rollout: Rollout, out: api.Output, attempts: int) -> Completion:
        """The rollout with the experts the server routed its tokens to, when asked for (a
        server that sends none cannot replay: a Failure that says how to start it)."""
        if self.routing is None:
            return rollout
        if out.routed_experts is None:
            self.stats.failures += 1
            return Failure(request, "the server sent no meta_info.routed_experts for routing replay: "
                           "start it with --enable-return-routed-experts", attempts)
        try:
            routed = api.decode_routed_experts(out.routed_experts, len(rollout.prompt_ids) + len(rollout.output_ids),
                                               self.routing)
        except api.ProtocolError as e:
            self.stats.failures += 1
            return Failure(request, str(e), attempts)
        return dataclasses.replace(rollout, routed_experts=routed)

    @staticmethod
    def _rollout(request: Request, ids, logprobs, finish, versions: list[int], began: float) -> Rollout:
        metadata = dict(request.metadata)
        if len(set(versions)) > 1:
            metadata["weight_versions"] = list(versions)
        return Rollout(prompt_ids=request.prompt_ids, output_ids=tuple(ids), output_logprobs=tuple(logprobs),
                       finish_reason=finish, weight_version=min(versions) if versions else 0, metadata=metadata,
                       request_id=request.request_id, latency_s=time.perf_counter() - began)

    async def stream(self, requests: Sequence[Request]) -> AsyncIterator[Completion]:
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids) or any(i in self._flights for i in ids):
            raise ValueError("request ids must be unique among the requests in flight")
        tasks = [asyncio.ensure_future(self._generate_one(r)) for r in requests]
        try:
            for next_done in asyncio.as_completed(tasks):
                yield await next_done
        finally:
            for task in tasks:
                task.cancel()

    async def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Teacher scoring: logp(token_i | tokens before it) for every token after the first of
        each sequence (`max_new_tokens=0`, `logprob_start_len=0`), with the same retries."""
        async def one(i: int, ids: Sequence[int]) -> list[float]:
            for attempt in range(1, self.max_retries + 2):
                url = self._pick()
                self._load[url] += 1
                try:
                    response = await self._call(url, "/generate", api.score_body(list(ids), f"score-{i}-{attempt}"))
                    self._check_status(url, response.status_code, response.text)
                    return api.parse_scores(response.json(), len(ids))
                except (httpx.TransportError, _Retryable, json.JSONDecodeError) as e:
                    if attempt > self.max_retries:
                        raise EngineError(f"scoring sequence {i} failed after {attempt} attempts: {e}") from None
                    await asyncio.sleep(self._backoff(attempt))
                finally:
                    self._load[url] -= 1
            raise AssertionError("unreachable")
        self._ensure()
        return list(await asyncio.gather(*(one(i, s) for i, s in enumerate(sequences))))

    # ------------------------------------------------------------------ control
    async def abort(self, request_ids: Sequence[str] | None = None) -> None:
        flights = list(self._flights.values()) if request_ids is None else \
            [self._flights[i] for i in request_ids if i in self._flights]
        for flight in flights:
            flight.aborted = True
        await asyncio.gather(*(self._call(f.url, "/abort_request", api.abort_body(f.rid))
                               for f in flights if f.url is not None), return_exceptions=True)

    async def pause(self) -> None:
        self._ensure()
        self._pause_epoch += 1
        self._running.clear()
        for url in self.urls:
            await self._control(url, "/pause_generation")

    async def resume(self) -> None:
        self._ensure()
        for url in self.urls:
            await self._control(url, "/continue_generation")
        self._running.set()

    async def _control(self, url: str, path: str, body: dict | None = None, method: str = "POST",
                       check: bool = True) -> httpx.Response:
        for attempt in range(1, 4):  # a kept-alive connection to a restarted server fails once
            try:
                response = await self._call(url, path, body, method)
                break
            except httpx.TransportError as e:
                if attempt == 3:
                    raise EngineError(f"{url}{path}: {type(e).__name__}: {e}") from None
                await asyncio.sleep(self._backoff(attempt))
        if check and response.status_code != 200 and response.status_code != 404:
            raise EngineError(f"{url}{path}: HTTP {response.status_code}: {response.text[:300]}")
        return response

    async def start(self) -> None:
        if self.servers is not None:
            await self.servers.start()
            self._launched = True  # whoever starts the servers stops them (close)
        # servers someone else starts (a cluster's, beside the trainer) may still be booting
        deadline = time.monotonic() + self.wait_for_servers_s
        while not await self.health():
            if time.monotonic() >= deadline:
                waited = f" within {self.wait_for_servers_s:g} s" if self.wait_for_servers_s else ""
                raise EngineError(f"no server answered its health check at {', '.join(self.urls)}{waited}")
            await asyncio.sleep(min(5.0, max(0.1, deadline - time.monotonic())))

    def metrics(self) -> dict[str, float]:
        out = {"retries": float(self.stats.retries), "interrupted": float(self.stats.interrupted),
               "failed_requests": float(self.stats.failures), "refit_s_total": self.stats.refit_s}
        if self.stats.prompt_tokens:  # the servers' radix cache, since the last call (as the embedded engine's)
            out["prefix_hit_frac"] = self.stats.cached_tokens / self.stats.prompt_tokens
            out["prefix_hit_tokens"] = float(self.stats.cached_tokens)
            self.stats.prompt_tokens = self.stats.cached_tokens = 0
        if self.servers is not None:
            out["server_crashes"] = float(self.servers.crashes())
        return out

    async def health(self) -> bool:
        self._ensure()
        for url in self.urls:
            try:
                if (await self._call(url, "/health", method="GET")).status_code == 200:
                    return True
            except httpx.TransportError:
                continue
        return False

    async def update_weights(self, update: WeightUpdate) -> None:
        """Write the policy as an HF directory, then on every server: pause_generation →
        flush_cache → update_weights_from_disk(path, version) → continue_generation, and check the
        version the server reports. A server without that endpoint is restarted on the new
        directory instead (refit='auto' with launched servers, or refit='restart')."""
        if update.save_hf is None:
            raise EngineError("this weight update has no Hugging Face export; SGLang refits from disk")
        began = time.perf_counter()
        directory = (self.refit_dir / f"v{update.version}").resolve()
        await asyncio.to_thread(update.save_hf, directory)
        await self.pause()
        try:
            for url in self.urls:
                await self._refit_one(url, directory, update.version)
            self._version = update.version
        finally:
            await self.resume()
        self.stats.refits += 1
        self.stats.refit_s += time.perf_counter() - began

    async def _refit_one(self, url: str, directory: Path, version: int) -> None:
        if self.refit != "restart":
            flushed = await self._control(url, "/flush_cache", check=False)
            response = await self._control(url, "/update_weights_from_disk",
                                           api.update_weights_body(str(directory), version))
            if response.status_code == 200:
                if flushed.status_code != 200:  # prefixes cached under the old weights could be reused
                    raise EngineError(f"{url}/flush_cache: HTTP {flushed.status_code}: {flushed.text[:300]}")
                result = response.json()
                if not result.get("success", False):
                    raise EngineError(f"{url} rejected update_weights_from_disk: {result.get('message')}")
                reported = (await self._control(url, "/get_weight_version", method="GET")).json()
                if str(reported.get("weight_version")) != str(version):
                    raise EngineError(f"{url} reports weight version {reported.get('weight_version')!r} "
                                      f"after a refit to {version}")
                return
            if self.refit == "disk" or self.servers is None:
                raise EngineError(f"{url} has no /update_weights_from_disk; launch the servers from the bridge "
                                  f"(rollout.sglang.launch) so it can restart them on new weights")
        await self.servers.restart(url, directory)
        info = (await self._control(url, "/get_model_info", method="GET")).json()
        if Path(str(info.get("model_path", ""))).resolve() != directory:
            raise EngineError(f"{url} serves {info.get('model_path')!r} after a restart onto {directory}")

    async def close(self) -> None:
        try:
            if self._client is not None:
                await self._client.aclose()
                self._client = None
        finally:
            if self._launched:
                await self.servers.close()
