"""An HTTP proxy in front of a real SGLang server that injects faults into `/generate` calls:
the n-th call gets `schedule[n % len(schedule)]`. Other paths pass through untouched.

Faults: "ok", "delay" (2 s, then forwarded), "reset" (connection dropped before any answer),
"500", "503", "cut" (a stream forwarded for two events, then dropped; a plain response dropped
after half its bytes), "garbage" (200 with a body that is not JSON / an event that is not JSON).
"""

from __future__ import annotations

import asyncio
import threading

import httpx
from aiohttp import web

FAULTS = ("ok", "delay", "reset", "500", "503", "cut", "garbage")


class FaultProxy:
    def __init__(self, upstream: str, schedule: list[str], port: int = 0):
        assert all(f in FAULTS for f in schedule), schedule
        self.upstream, self.schedule, self.port = upstream, schedule, port
        self.calls: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)

    async def _start(self) -> str:
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(300.0))
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def close(self) -> None:
        async def stop():
            await self._runner.cleanup()
            await self._client.aclose()
        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        path = "/" + request.match_info["path"]
        fault = "ok"
        if path == "/generate":
            fault = self.schedule[len(self.calls) % len(self.schedule)]
            self.calls.append(fault)
        if fault == "reset":
            request.transport.abort()
            return web.Response(status=500)
        if fault in ("500", "503"):
            return web.Response(status=int(fault), text=f"injected {fault}")
        if fault == "delay":
            await asyncio.sleep(2.0)
        streaming = b'"stream": true' in body or b'"stream":true' in body
        upstream = self._client.build_request(request.method, self.upstream + path, content=body,
                                              headers={"content-type": "application/json"})
        response = await self._client.send(upstream, stream=True)
        try:
            if fault == "garbage":
                return web.Response(status=200, text="data: {not json\n\n" if streaming else '{"meta_info": ',
                                    content_type="text/event-stream" if streaming else "application/json")
            out = web.StreamResponse(status=response.status_code,
                                     headers={"content-type": response.headers.get("content-type", "application/json")})
            await out.prepare(request)
            if fault == "cut":
                if streaming:
                    events = 0
                    async for line in response.aiter_lines():
                        await out.write((line + "\n").encode())
                        events += line.startswith("data:")
                        if events >= 2:
                            break
                else:
                    data = await response.aread()
                    await out.write(data[: len(data) // 2])
                request.transport.abort()
                return out
            async for chunk in response.aiter_raw():
                await out.write(chunk)
            await out.write_eof()
            return out
        finally:
            await response.aclose()
