"""Which asyncio HTTP stack adds the least per request: aiohttp's server, or uvicorn with a bare ASGI app.

Both serve the same trivial POST (read the body, answer 16 bytes) from a server thread with its own
event loop, as the daemon runs its HTTP frontend; the client is ``http.client`` on one keep-alive
connection, sequential, so the number is the stack's round trip.  ``--short`` runs 1,000 requests each.

    .venv/bin/python bench/bench_http_stacks.py --short
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import socket
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_aiohttp(port: int, ready: threading.Event, stop: threading.Event) -> None:
    from aiohttp import web

    async def infer(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b'{"outputs": []}\n', content_type="application/json")

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v2/models/m/infer", infer)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await runner.cleanup()

    asyncio.run(main())


def serve_uvicorn(port: int, ready: threading.Event, stop: threading.Event, loop: str) -> None:
    import uvicorn

    async def app(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        body = b'{"outputs": []}\n'
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"16")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, loop=loop, http="httptools", log_level="warning", access_log=False
    )
    server = uvicorn.Server(config)

    async def main() -> None:
        task = asyncio.ensure_future(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        server.should_exit = True
        await task

    if loop == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


def measure(port: int, count: int) -> list[float]:
    conn = http.client.HTTPConnection("127.0.0.1", port)
    body = b"x" * 64
    times = []
    for i in range(count + 200):
        start = time.perf_counter()
        conn.request("POST", "/v2/models/m/infer", body, {"Content-Type": "application/octet-stream"})
        response = conn.getresponse()
        response.read()
        if i >= 200:  # warm-up
            times.append(time.perf_counter() - start)
    conn.close()
    return times


def run(name: str, target: Callable[..., None], *args: Any, count: int) -> None:
    port = free_port()
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=target, args=(port, ready, stop, *args), daemon=True)
    thread.start()
    ready.wait(10)
    times = measure(port, count)
    stop.set()
    thread.join(5)
    times.sort()
    print(
        f"{name:<28} mean {statistics.mean(times) * 1e6:7.1f} us   p50 {times[len(times) // 2] * 1e6:7.1f} us"
        f"   p99 {times[int(len(times) * 0.99)] * 1e6:7.1f} us"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--short", action="store_true")
    args = parser.parse_args()
    count = 1000 if args.short else 10000
    for _ in range(2):
        run("aiohttp (asyncio loop)", serve_aiohttp, count=count)
        run("uvicorn+httptools (asyncio)", serve_uvicorn, "asyncio", count=count)
        run("uvicorn+httptools (uvloop)", serve_uvicorn, "uvloop", count=count)


if __name__ == "__main__":
    main()
