"""Local SGLang server processes: launch from a command template, wait for health, restart on a
crash or on request (the refit strategy for servers without update_weights_from_disk).

The template is a list of arguments with `{model_path}`, `{host}` and `{port}` placeholders, e.g.
`["python", "-m", "sglang.launch_server", "--model-path", "{model_path}", "--port", "{port}"]`.
Each server runs in its own process group, so its scheduler children go with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import time
from pathlib import Path

import httpx

from rollout_bridge.protocol import EngineError


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    command: tuple[str, ...]
    num_servers: int = 1
    host: str = "127.0.0.1"
    ports: tuple[int, ...] = ()  # empty: free ports are chosen
    env: tuple[tuple[str, str], ...] = ()
    startup_timeout_s: float = 600.0
    log_dir: Path = Path("sglang_logs")

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("launch command is empty")
        if not any("{model_path}" in part for part in self.command):
            raise ValueError("launch command has no {model_path} placeholder")
        if not any("{port}" in part for part in self.command):
            raise ValueError("launch command has no {port} placeholder")
        if self.ports and len(self.ports) != self.num_servers:
            raise ValueError(f"{len(self.ports)} ports given for {self.num_servers} servers")


@dataclasses.dataclass
class _Server:
    port: int
    model_path: str
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    crashes: int = 0
    restarting: bool = False


class ServerGroup:
    """The servers of one LaunchSpec; `urls` are theirs once `start()` returns."""

    def __init__(self, spec: LaunchSpec, model_path: str | os.PathLike):
        self.spec = spec
        ports = spec.ports or tuple(free_port(spec.host) for _ in range(spec.num_servers))
        self._servers = {f"http://{spec.host}:{p}": _Server(p, str(model_path)) for p in ports}
        self._watch: asyncio.Task | None = None
        self._closing = False

    @property
    def urls(self) -> list[str]:
        return list(self._servers)

    def model_path(self, url: str) -> str:
        return self._servers[url].model_path

    def is_up(self, url: str) -> bool:
        server = self._servers[url]
        return not server.restarting and server.process is not None and server.process.returncode is None

    def restarts(self) -> int:
        return sum(s.restarts for s in self._servers.values())

    def crashes(self) -> int:
        return sum(s.crashes for s in self._servers.values())

    def log_path(self, url: str) -> Path:
        return self.spec.log_dir / f"server_{self._servers[url].port}.log"

    async def start(self) -> None:
        await asyncio.gather(*(self._launch(url) for url in self._servers))
        self._watch = asyncio.get_running_loop().create_task(self._supervise())

    async def restart(self, url: str, model_path: str | os.PathLike | None = None) -> None:
        """Stop the server at `url` and launch it again (on `model_path` if given)."""
        server = self._servers[url]
        server.restarting = True
        try:
            await self._stop(server)
            if model_path is not None:
                server.model_path = str(model_path)
            server.restarts += 1
            await self._launch(url)
        finally:
            server.restarting = False

    async def close(self) -> None:
        self._closing = True
        if self._watch is not None:
            self._watch.cancel()
        await asyncio.gather(*(self._stop(s) for s in self._servers.values()))

    def kill(self, url: str) -> None:
        """SIGKILL one server, as a crash would (for fault tests); supervision brings it back."""
        process = self._servers[url].process
        if process is not None and process.returncode is None:
            os.killpg(process.pid, signal.SIGKILL)

    # ------------------------------------------------------------------ internals
    def _argv(self, server: _Server) -> list[str]:
        values = {"model_path": server.model_path, "host": self.spec.host, "port": str(server.port)}
        return [part.format(**values) for part in self.spec.command]

    async def _launch(self, url: str) -> None:
        server = self._servers[url]
        self.spec.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_path(url).open("ab")
        log.write(f"\n=== launch {time.strftime('%H:%M:%S')}: {' '.join(self._argv(server))}\n".encode())
        log.flush()
        server.process = await asyncio.create_subprocess_exec(
            *self._argv(server), stdout=log, stderr=log, start_new_session=True,
            env={**os.environ, **dict(self.spec.env)})
        log.close()
        await self._wait_healthy(url, server)

    async def _wait_healthy(self, url: str, server: _Server) -> None:
        deadline = time.monotonic() + self.spec.startup_timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if server.process.returncode is not None:
                    raise EngineError(f"server {url} exited with code {server.process.returncode} while starting; "
                                      f"last lines of {self.log_path(url)}:\n{self._tail(url)}")
                try:
                    if (await client.get(url + "/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.5)
        await self._stop(server)
        raise EngineError(f"server {url} was not healthy after {self.spec.startup_timeout_s:.0f} s; "
                          f"last lines of {self.log_path(url)}:\n{self._tail(url)}")

    def _tail(self, url: str, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path(url).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    async def _stop(self, server: _Server) -> None:
        process = server.process
        if process is None or process.returncode is not None:
            return
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                return
            try:
                await asyncio.wait_for(process.wait(), wait)
                return
            except TimeoutError:
                continue

    async def _supervise(self) -> None:
        """Relaunch any server that dies on its own, on the weights it was serving."""
        while not self._closing:
            await asyncio.sleep(0.5)
            for url, server in self._servers.items():
                if server.restarting or server.process is None or server.process.returncode is None:
                    continue
                server.crashes += 1
                server.restarting = True
                try:
                    await self._launch(url)
                except EngineError:
                    pass  # tried again on the next pass
                finally:
                    server.restarting = False

