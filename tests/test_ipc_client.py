"""The client libraries against a scripted ROUTER: what exactly they put on the wire, sync and async."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from edge_server.client import AsyncClient, Client
from edge_server.ipc import protocol
from tests.daemon import start_pyzmq_gc

X = np.arange(4, dtype=np.float32)


class ScriptedDaemon:
    """A ROUTER on its own thread that answers every request ``ok`` and records the headers.

    ``live`` gets ``max_message_bytes`` like the real daemon's; ``infer`` gets no outputs.
    """

    def __init__(self, address: str, *, max_message_bytes: int = 1 << 20) -> None:
        self.address = address
        self.max_message_bytes = max_message_bytes
        self.headers: list[dict[str, Any]] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="scripted-daemon")
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(20):
                continue
            identity, first, *_ = self._sock.recv_multipart()
            request = protocol.unpack(first)
            self.headers.append(request)
            fields: dict[str, Any] = {}
            if request["op"] == "live":
                fields = {"live": True, "max_message_bytes": self.max_message_bytes}
            elif request["op"] == "infer":
                fields = {"outputs": []}
            self._sock.send_multipart([identity, protocol.pack(protocol.ok_header(request["id"], **fields))])

    def ops(self) -> list[str]:
        return [h["op"] for h in self.headers]

    def infers(self) -> list[dict[str, Any]]:
        return [h for h in self.headers if h["op"] == "infer"]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(0)
        self._ctx.term()


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[ScriptedDaemon]:
    start_pyzmq_gc()
    fake = ScriptedDaemon(f"ipc://{tmp_path}/scripted.sock")
    yield fake
    fake.close()


def test_reply_timeout_is_not_sent_as_a_queue_timeout(scripted: ScriptedDaemon) -> None:
    """The client's patience is its own: the daemon keeps the model's queue policy unless asked."""
    with Client(scripted.address, timeout=5) as client:
        client.infer("m", {"A": X})
        client.infer("m", {"A": X}, timeout=0.5)
        client.submit("m", {"A": X}, timeout=2).result(5)
        client.infer("m", {"A": X}, queue_timeout_us=2500)
        client.submit("m", {"A": X}, queue_timeout_us=0).result(5)
    assert [h.get("timeout_us") for h in scripted.infers()] == [None, None, None, 2500, 0]
    assert scripted.ops()[0] == "live"  # the daemon's limit is asked before anything else


def test_async_reply_timeout_is_not_sent_as_a_queue_timeout(scripted: ScriptedDaemon) -> None:
    async def main() -> None:
        async with AsyncClient(scripted.address, timeout=5) as client:
            await client.infer("m", {"A": X})
            await client.infer("m", {"A": X}, timeout=0.5)
            await client.infer("m", {"A": X}, queue_timeout_us=2500)

    asyncio.run(main())
    assert [h.get("timeout_us") for h in scripted.infers()] == [None, None, 2500]
    assert scripted.ops()[0] == "live"


def test_requests_over_the_daemons_limit_are_never_sent(tmp_path: Path) -> None:
    """Queued before the limit was known (right after connecting), refused once it is."""
    start_pyzmq_gc()
    fake = ScriptedDaemon(f"ipc://{tmp_path}/small.sock", max_message_bytes=4096)
    try:
        with Client(fake.address, timeout=5) as client:
            too_big = client.submit("m", {"A": np.zeros(2048, np.float32)})  # 8 KiB, limit not known yet
            with pytest.raises(Exception) as caught:
                too_big.result(5)
            assert getattr(caught.value, "code", None) == "MESSAGE_TOO_LARGE"
            client.infer("m", {"A": X})
            with pytest.raises(Exception) as caught:  # now known: refused before it is queued
                client.submit("m", {"A": np.zeros(2048, np.float32)})
            assert getattr(caught.value, "code", None) == "MESSAGE_TOO_LARGE"

        async def main() -> None:
            async with AsyncClient(fake.address, timeout=5) as client:
                with pytest.raises(Exception) as caught:
                    await client.infer("m", {"A": np.zeros(2048, np.float32)})
                assert getattr(caught.value, "code", None) == "MESSAGE_TOO_LARGE"
                await client.infer("m", {"A": X})

        asyncio.run(main())
        assert len(fake.infers()) == 2 and all(h["inputs"][0]["shape"] == [4] for h in fake.infers())
    finally:
        fake.close()


def test_async_client_has_the_sync_clients_calls() -> None:
    """Same names, same parameters: the two clients share their call logic, only the I/O differs."""
    sync_only = {"submit"}
    for name, method in inspect.getmembers(Client, inspect.isfunction):
        if name.startswith("_") or name in sync_only:
            continue
        other = getattr(AsyncClient, name, None)
        assert other is not None and inspect.iscoroutinefunction(other), name
        assert list(inspect.signature(other).parameters) == list(inspect.signature(method).parameters), name
