"""Hostile messages over IPC: bounded memory, stable error codes, and the daemon stays up."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from edge_server.client import Client
from edge_server.ipc import protocol
from tests.daemon import Daemon, RawPeer, header, status_kib


def still_serves(daemon: Daemon) -> None:
    with Client(daemon.address, timeout=10) as client:
        x = np.arange(16, dtype=np.float32)
        np.testing.assert_array_equal(client.infer("identity", {"INPUT0": x})["OUTPUT0"], x)


def test_a_huge_header_of_empty_maps_is_refused_unread(daemon: Daemon) -> None:
    before = status_kib(daemon.pid, "VmHWM")
    count = 16 * 1024 * 1024
    evil = b"\xdd" + count.to_bytes(4, "big") + b"\x80" * count  # array32 of 16 Mi empty maps
    peer = RawPeer(daemon.address)
    try:
        reply = peer.ask([evil])
    finally:
        peer.close()
    assert reply["error"]["code"] == "MESSAGE_TOO_LARGE"
    grown_mib = (status_kib(daemon.pid, "VmHWM") - before) / 1024
    assert grown_mib < 200, f"the daemon's peak RSS grew {grown_mib:.0f} MiB"
    still_serves(daemon)


def test_a_header_within_the_size_limit_but_with_huge_containers_is_malformed(daemon: Daemon) -> None:
    big = msgpack.packb({"v": 1, "id": 1, "op": "live", "pad": [0] * 100_000})
    assert len(big) < protocol.DEFAULT_MAX_HEADER_BYTES
    peer = RawPeer(daemon.address)
    try:
        assert peer.ask([big])["error"]["code"] == "MALFORMED_MESSAGE"
    finally:
        peer.close()


def test_a_million_empty_frames_are_not_kept(daemon: Daemon) -> None:
    before = status_kib(daemon.pid, "VmHWM")
    peer = RawPeer(daemon.address)
    try:
        frames = [header(op="live")] + [b""] * 300_000
        reply = peer.ask(frames)
    finally:
        peer.close()
    assert reply["error"]["code"] == "MALFORMED_MESSAGE" and "frames" in reply["error"]["message"]
    grown_mib = (status_kib(daemon.pid, "VmHWM") - before) / 1024
    assert grown_mib < 100, f"the daemon's peak RSS grew {grown_mib:.0f} MiB"
    still_serves(daemon)


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"v": [1]}, "UNSUPPORTED_VERSION"),
        ({"v": {"a": 1}}, "UNSUPPORTED_VERSION"),
        ({"v": 1.0}, "UNSUPPORTED_VERSION"),
        ({"v": 2}, "UNSUPPORTED_VERSION"),
    ],
)
def test_version_of_the_wrong_type_gets_a_stable_code(daemon: Daemon, fields: dict, code: str) -> None:
    peer = RawPeer(daemon.address)
    try:
        reply = peer.ask([msgpack.packb({"id": 3, "op": "live", **fields})])
    finally:
        peer.close()
    assert reply["error"]["code"] == code


@pytest.mark.parametrize(
    "shape",
    [[2**63], [2**64 - 1], [0, 2**63 - 1], [2**62, 0], [1] * 65, [0] * 33, [-1]],
)
def test_absurd_shapes_get_a_stable_code(daemon: Daemon, shape: list[int]) -> None:
    desc = {"name": "INPUT0", "datatype": "FP32", "shape": shape, "frame": 0}
    peer = RawPeer(daemon.address)
    try:
        reply = peer.ask([header(op="infer", model="identity", inputs=[desc]), b""])
    finally:
        peer.close()
    assert reply["error"]["code"] in ("MALFORMED_MESSAGE", "TENSOR_SIZE_MISMATCH"), reply
    still_serves(daemon)


def test_an_8_mib_model_name_is_not_echoed_back(daemon: Daemon) -> None:
    desc = {"name": "INPUT0", "datatype": "FP32", "shape": [16], "frame": 0}
    peer = RawPeer(daemon.address)
    try:
        name = "m" * (8 << 20)
        big = protocol.pack({"v": 1, "id": 1, "op": "infer", "model": name, "inputs": [desc]})
        # over the header limit: refused unread; a long-but-allowed name is cut in the message
        assert peer.ask([big, np.zeros(16, np.float32).tobytes()])["error"]["code"] == "MESSAGE_TOO_LARGE"
        name = "m" * 100_000
        reply = peer.ask([header(op="infer", model=name, inputs=[desc]), np.zeros(16, np.float32).tobytes()])
    finally:
        peer.close()
    assert reply["error"]["code"] == "INVALID_ARGUMENT"
    assert len(reply["error"]["message"]) < 400


def test_descriptor_exhaustion_is_refused_cleanly_never_an_abort(
    tmp_path: pytest.TempPathFactory, no_leaked_processes: None
) -> None:
    """libzmq aborts the process when accept() fails with EMFILE: with a low RLIMIT_NOFILE and more
    connections than descriptors, the daemon must stop accepting at its cap, stay up, and accept again
    once connections close."""
    import zmq

    from edge_server.ipc import addresses
    from tests.daemon import build_repository, start_daemon, stop_daemon, wait_for

    proc = start_daemon(tmp_path, build_repository(tmp_path), "fd.sock", nofile=256)
    ctx = zmq.Context()
    socks = []
    try:
        for _ in range(600):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(proc.address)
            socks.append(sock)
        # At its cap the daemon moves its socket file out of connect's way (the OS shows it).
        path = addresses.ipc_path(proc.address)
        assert path is not None
        wait_for(lambda: addresses.paused_path(path).exists(), timeout=30, what="the daemon's cap")
        assert proc.proc is not None and proc.proc.poll() is None, proc.log()
        for sock in socks:
            sock.close(0)
        socks.clear()
        still_serves(proc)  # its client reconnects until the daemon accepts again
        with Client(proc.address, timeout=10) as client:
            status = client.ipc_status()
            assert status["paused_accepting"] > 0, status  # the listener closed at the cap, and came back
    finally:
        for sock in socks:
            sock.close(0)
        ctx.term()
        assert stop_daemon(proc) == 0, proc.log()


def test_requests_in_flight_are_limited_per_client_and_in_total(
    tmp_path: pytest.TempPathFactory, no_leaked_processes: None
) -> None:
    """A client may not queue without bound: over --max-client-requests its next request is refused
    TOO_MANY_REQUESTS (others are still served), and over --max-requests every client's is."""
    from edge_server.errors import EdgeServerError
    from tests.daemon import build_repository, start_daemon, stop_daemon

    proc = start_daemon(
        tmp_path, build_repository(tmp_path), "lim.sock", "--max-client-requests", "3", "--max-requests", "5"
    )
    gate = proc.gate
    assert gate is not None
    x = np.zeros(4, np.float32)
    try:
        with Client(proc.address, timeout=30) as first, Client(proc.address, timeout=30) as second:
            held = [first.submit("gate", {"INPUT0": x}) for _ in range(3)]
            gate.wait_started()  # one runs, two wait in the gate model's queue
            with pytest.raises(EdgeServerError) as refused:
                first.infer("identity", {"INPUT0": x})
            assert refused.value.code == "TOO_MANY_REQUESTS"
            assert "--max-client-requests" in refused.value.message
            np.testing.assert_array_equal(second.infer("identity", {"INPUT0": x})["OUTPUT0"], x)
            held += [second.submit("gate", {"INPUT0": x}) for _ in range(2)]  # 5 in flight in all
            with pytest.raises(EdgeServerError) as full:
                second.infer("gate", {"INPUT0": x})
            assert full.value.code == "TOO_MANY_REQUESTS"
            assert "--max-requests" in full.value.message
            gate.release(5)
            for future in held:
                np.testing.assert_array_equal(future.result(timeout=30)["OUTPUT0"], x)
            gate.wait_started(4)
            # answered requests no longer count: both clients may send again
            np.testing.assert_array_equal(first.infer("identity", {"INPUT0": x})["OUTPUT0"], x)
            np.testing.assert_array_equal(second.infer("identity", {"INPUT0": x})["OUTPUT0"], x)
    finally:
        assert stop_daemon(proc) == 0, proc.log()


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_limits_must_be_positive_whole_numbers(value: str) -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "edge_server", "serve", "--max-client-requests", value],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--max-client-requests" in done.stderr and "Traceback" not in done.stderr


def test_regions_per_client_are_limited_by_a_flag(
    tmp_path: pytest.TempPathFactory, no_leaked_processes: None
) -> None:
    from edge_server.errors import EdgeServerError
    from tests.daemon import build_repository, start_daemon, stop_daemon

    proc = start_daemon(tmp_path, build_repository(tmp_path), "reg.sock", "--max-client-regions", "2")
    try:
        with Client(proc.address, timeout=30) as client, Client(proc.address, timeout=30) as other:
            regions = [client.create_shm_region(4096) for _ in range(2)]
            with pytest.raises(EdgeServerError) as refused:
                client.create_shm_region(4096)
            assert "at most 2 regions" in refused.value.message
            other.release_shm(other.create_shm_region(4096))  # the limit is per client
            for region in regions:
                client.release_shm(region)
            client.release_shm(client.create_shm_region(4096))  # released regions no longer count
    finally:
        assert stop_daemon(proc) == 0, proc.log()


def test_connections_and_frames_per_message_are_flags(
    tmp_path: pytest.TempPathFactory, no_leaked_processes: None
) -> None:
    """--max-frames bounds one message; --max-connections closes the door at the cap and opens it again."""
    from tests.daemon import build_repository, start_daemon, stop_daemon

    proc = start_daemon(
        tmp_path, build_repository(tmp_path), "flags.sock", "--max-frames", "3", "--max-connections", "2"
    )
    try:
        first = RawPeer(proc.address)
        x = np.zeros(4, np.float32)
        desc = {"name": "INPUT0", "datatype": "FP32", "shape": [4], "frame": 0}
        too_many = first.ask([header(op="infer", model="identity", inputs=[desc]), x, x, x])
        assert too_many["error"]["code"] == "MALFORMED_MESSAGE"
        assert "--max-frames" in too_many["error"]["message"]
        one = first.ask([header(op="infer", model="identity", inputs=[desc]), x])
        assert one["ok"], one
        with Client(proc.address, timeout=30) as second:  # the second connection: at the cap
            status = second.ipc_status()
            assert status["connections"] == 2 and status["paused_accepting"] == 1, status
            first.close()
            np.testing.assert_array_equal(second.infer("identity", {"INPUT0": x})["OUTPUT0"], x)
        still_serves(proc)  # a connection closed: the door is open again
    finally:
        assert stop_daemon(proc) == 0, proc.log()
