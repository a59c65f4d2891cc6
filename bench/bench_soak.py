"""Soak: many clients, hot reloads, clients killed mid-request and malformed messages, all at once.

    .venv/bin/python bench/bench_soak.py [--minutes 10] [--quick] [--clients 4]

The real daemon serves a watched repository (poll mode) with ``identity`` (the example model) and
``m``, whose version ``k`` answers ``x + k``.  For the whole run, at the same time:

* sync clients (one thread each), inline tensors, checking every answer;
* sync clients through shared memory (registered region, inputs and outputs in it);
* one asyncio client with 16 requests in flight at a time;
* a new version of ``m`` dropped into the repository (renamed in, the OTA way) every few seconds;
* a client process that sends a burst of requests and is SIGKILLed mid-request, every few seconds;
* malformed messages (garbage, bad headers, wrong versions, too many frames) on a raw socket, each of
  which must be answered with a stable error code.

Reported: requests answered, errors by code (only the codes listed as expected for their sender are
allowed), lost replies (a call with no answer within 30 s: must be 0), and the daemon's RSS and open
descriptors at the start, every minute, and at the end.  Exits 1 if anything unexpected happened.
``--quick`` runs 30 s.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edge_server.client import AsyncClient, Client  # noqa: E402
from edge_server.errors import EdgeServerError  # noqa: E402
from edge_server.ipc import protocol  # noqa: E402
from tests.daemon import EXAMPLES, Daemon  # noqa: E402
from tests.onnx_factory import affine_model  # noqa: E402
from tests.reload_helpers import write_config  # noqa: E402

REPLY_TIMEOUT_S = 30.0
#: Codes a malformed message may get; anything else (INTERNAL above all) fails the soak.
MALFORMED_CODES = {"MALFORMED_MESSAGE", "UNSUPPORTED_VERSION", "UNKNOWN_OP", "MESSAGE_TOO_LARGE",
                   "INVALID_ARGUMENT", "MODEL_NOT_FOUND", "TENSOR_SIZE_MISMATCH"}  # fmt: skip
LOST_CODES = {"TIMEOUT", "CONNECTION_LOST"}

VICTIM = """
import sys, numpy as np
from edge_server.client import Client
c = Client(sys.argv[1], timeout=30)
region = c.create_shm_region(1 << 16)
x = np.arange(4, dtype=np.float32).reshape(1, 4)
futures = [c.submit("m", {"INPUT0": x}) for _ in range(200)]
futures += [c.submit("identity", {"INPUT0": region.write(np.ones(16, np.float32))}) for _ in range(50)]
print("sent", flush=True)
futures[-1].result()
import time; time.sleep(60)
"""


def proc_stats(pid: int) -> tuple[int, int]:
    """(RSS in KiB, open descriptors) of ``pid``."""
    with open(f"/proc/{pid}/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


class Tally:
    """Thread-safe counters: answered requests, errors by (sender, code), and what was unexpected."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.answered: collections.Counter[str] = collections.Counter()
        self.errors: collections.Counter[tuple[str, str]] = collections.Counter()
        self.unexpected: list[str] = []

    def ok(self, who: str) -> None:
        with self._lock:
            self.answered[who] += 1

    def error(self, who: str, code: str, message: str, *, expected: bool) -> None:
        with self._lock:
            self.errors[(who, code)] += 1
            if not expected and len(self.unexpected) < 20:
                self.unexpected.append(f"{who}: [{code}] {message[:200]}")

    @property
    def lost(self) -> int:
        return sum(n for (_, code), n in self.errors.items() if code in LOST_CODES)


class Soak:
    def __init__(self, work: Path, seconds: float, clients: int) -> None:
        self.work, self.seconds, self.n_clients = work, seconds, clients
        self.repo = work / "repo"
        self.staging = work / "staging"
        self.staging.mkdir(parents=True)
        shutil.copytree(
            EXAMPLES / "identity", self.repo / "identity", ignore=shutil.ignore_patterns("samples")
        )
        write_config(self.repo / "m")
        affine_model(self.repo / "m" / "1" / "model.onnx", offset=1.0)
        self.version = 1
        self.versions_seen = {1}
        self.stop = threading.Event()
        self.tally = Tally()
        self.daemon = Daemon(
            self.repo, f"ipc://{work}/soak.sock", work / "daemon.log", "--model-control-mode", "poll"
        )
        self.reloads = 0
        self.kills = 0
        self.malformed = 0
        self.samples: list[tuple[float, int, int]] = []

    # -- workers --------------------------------------------------------------------------------

    def _call(self, who: str, call: Any, check: Any) -> None:
        try:
            check(call())
        except EdgeServerError as exc:
            self.tally.error(who, exc.code, exc.message, expected=False)
        except AssertionError as exc:
            self.tally.error(who, "WRONG_ANSWER", str(exc), expected=False)
        else:
            self.tally.ok(who)

    def _check_m(self, out: dict[str, np.ndarray]) -> None:
        k = float(out["OUTPUT0"][0, 0])  # x = 0 at [0, 0]: the answer is the version
        assert k == int(k) and int(k) in self.versions_seen, f"m answered {k}"

    def sync_inline(self) -> None:
        x = np.zeros((1, 4), np.float32)
        y = np.arange(16, dtype=np.float32)
        with Client(self.daemon.address, timeout=REPLY_TIMEOUT_S) as client:
            while not self.stop.is_set():
                self._call("sync-inline", lambda: client.infer("m", {"INPUT0": x}), self._check_m)
                self._call(
                    "sync-inline",
                    lambda: client.infer("identity", {"INPUT0": y}),
                    lambda out: np.testing.assert_array_equal(out["OUTPUT0"], y),
                )

    def sync_shm(self) -> None:
        with Client(self.daemon.address, timeout=REPLY_TIMEOUT_S) as client:
            region = client.create_shm_region(1 << 16)
            rng = np.random.default_rng()
            while not self.stop.is_set():
                y = rng.random(64, dtype=np.float32)
                ref = region.write(y, offset=0)
                self._call(
                    "sync-shm",
                    lambda ref=ref: client.infer(
                        "identity", {"INPUT0": ref}, outputs={"OUTPUT0": region.output(4096, 256)}
                    ),
                    lambda out, y=y: np.testing.assert_array_equal(out["OUTPUT0"], y),
                )

    def async_client(self) -> None:
        async def run() -> None:
            x = np.zeros((1, 4), np.float32)
            async with AsyncClient(self.daemon.address, timeout=REPLY_TIMEOUT_S) as client:
                while not self.stop.is_set():
                    results = await asyncio.gather(
                        *(client.infer("m", {"INPUT0": x}) for _ in range(16)), return_exceptions=True
                    )
                    for result in results:
                        if isinstance(result, EdgeServerError):
                            self.tally.error("async", result.code, result.message, expected=False)
                        elif isinstance(result, BaseException):
                            self.tally.error("async", type(result).__name__, repr(result), expected=False)
                        else:
                            self._call("async", lambda r=result: r, self._check_m)

        asyncio.run(run())

    def reloader(self, every: float) -> None:
        while not self.stop.wait(every):
            self.version += 1
            staged = self.staging / str(self.version)
            affine_model(staged / "model.onnx", offset=float(self.version))
            self.versions_seen.add(self.version)  # before the rename: an answer may come at once
            os.rename(staged, self.repo / "m" / str(self.version))
            self.reloads += 1
            old = self.repo / "m" / str(self.version - 3)
            if old.exists():  # latest 1 serves the newest; keep the folder small
                shutil.rmtree(old)

    def killer(self, every: float) -> None:
        while not self.stop.wait(every):
            victim = subprocess.Popen(
                [sys.executable, "-c", VICTIM, self.daemon.address],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
            assert victim.stdout is not None
            victim.stdout.readline()  # its requests are on their way
            time.sleep(random.uniform(0.0, 0.05))
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            victim.stdout.close()
            self.kills += 1

    def malformer(self, every: float) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.daemon.address)
        rng = random.Random(7)
        v = protocol.PROTOCOL_VERSION
        messages: list[list[bytes]] = [
            [b"\xc1garbage"],
            [protocol.pack({"v": v, "id": 1})],
            [protocol.pack({"v": "x", "id": 1, "op": "live"})],
            [protocol.pack({"v": v, "id": 1, "op": "explode"})],
            [protocol.pack({"v": v, "id": 1, "op": "infer", "model": "../etc"})],
            [
                protocol.pack(
                    {
                        "v": v,
                        "id": 1,
                        "op": "infer",
                        "model": "identity",
                        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [2**62], "frame": 0}],
                    }
                ),
                b"1234",
            ],  # fmt: skip
        ]
        # Too many frames: answered, and then the daemon cuts the connection off and refuses its uid's
        # new ones for a while (a penalty: draining the frames cost it); sent once, last, so that the
        # penalty falls after the run and no message sent behind it is lost with the connection.
        over_frame_limit = [protocol.pack({"v": v, "id": 1, "op": "live"})] + [b""] * 2000
        try:
            while not self.stop.wait(every):
                self._malformed_once(sock, rng.choice(messages))
            self._malformed_once(sock, over_frame_limit)
        finally:
            sock.close(0)
            ctx.term()

    def _malformed_once(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        sock.send_multipart(frames)
        if not sock.poll(int(REPLY_TIMEOUT_S * 1000)):
            self.tally.error("malformed", "TIMEOUT", "no answer to a malformed message", expected=False)
            return
        reply = protocol.unpack(sock.recv_multipart()[0])
        code = reply.get("error", {}).get("code", "OK")
        self.tally.error("malformed", code, str(reply)[:200], expected=code in MALFORMED_CODES)
        self.malformed += 1

    # -- the run --------------------------------------------------------------------------------

    def run(self) -> int:
        self.daemon.start()
        pid = self.daemon.pid
        quick = self.seconds <= 60
        workers = [self.sync_inline] * self.n_clients + [self.sync_shm] * max(1, self.n_clients // 2)
        workers += [self.async_client]
        extra = [
            (self.reloader, 3.0 if quick else 5.0),
            (self.killer, 2.0 if quick else 4.0),
            (self.malformer, 0.05),
        ]
        threads = [threading.Thread(target=w, daemon=True) for w in workers]
        threads += [threading.Thread(target=w, args=(e,), daemon=True) for w, e in extra]
        time.sleep(0)
        start_rss, start_fds = proc_stats(pid)
        began = time.monotonic()
        self.samples.append((0.0, start_rss, start_fds))
        for thread in threads:
            thread.start()
        sample_every = 10.0 if quick else 60.0
        while time.monotonic() - began < self.seconds:
            time.sleep(
                min(sample_every, self.seconds - (time.monotonic() - began)) if self.seconds > 0 else 0
            )
            self.samples.append((time.monotonic() - began, *proc_stats(pid)))
            if self.daemon.proc is not None and self.daemon.proc.poll() is not None:
                self.tally.error(
                    "daemon", "DIED", f"exit status {self.daemon.proc.returncode}", expected=False
                )
                break
        self.stop.set()
        for thread in threads:
            thread.join(REPLY_TIMEOUT_S + 10)
        hung = sum(t.is_alive() for t in threads)
        time.sleep(2.0)  # the killed clients' state is released (probes), then the last sample
        end = proc_stats(pid)
        status = self.daemon.stop()
        self.report(time.monotonic() - began, end, hung, status)
        bad = self.tally.unexpected or self.tally.lost or hung or status != 0
        return 1 if bad else 0

    def report(self, elapsed: float, end: tuple[int, int], hung: int, status: int) -> None:
        tally = self.tally
        print(f"## Soak: {elapsed / 60:.1f} min, {self.n_clients} inline + "
              f"{max(1, self.n_clients // 2)} shm sync clients, 1 async client (16 in flight)\n")  # fmt: skip
        print("| what | count |\n|---|---:|")
        for who, n in sorted(tally.answered.items()):
            print(f"| answered ({who}) | {n} |")
        print(f"| hot reloads (versions dropped) | {self.reloads} |")
        print(f"| client processes SIGKILLed mid-request | {self.kills} |")
        print(f"| malformed messages answered | {self.malformed} |")
        print(f"| lost replies | {tally.lost} |")
        print(f"| worker threads that never returned | {hung} |")
        print(f"| daemon exit status | {status} |")
        print("\n| sender | code | count |\n|---|---|---:|")
        for (who, code), n in sorted(tally.errors.items()):
            print(f"| {who} | {code} | {n} |")
        print("\n| t (s) | RSS (MiB) | open fds |\n|---:|---:|---:|")
        for t, rss, fds in self.samples:
            print(f"| {t:.0f} | {rss / 1024:.0f} | {fds} |")
        print(f"| end | {end[0] / 1024:.0f} | {end[1]} |")
        if tally.unexpected:
            print("\nUnexpected:")
            for line in tally.unexpected:
                print(f"- {line}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true", help="30 seconds")
    parser.add_argument("--clients", type=int, default=4, help="sync inline clients (half as many shm)")
    args = parser.parse_args()
    seconds = 30.0 if args.quick else args.minutes * 60.0
    work = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    try:
        return Soak(work, seconds, args.clients).run()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
