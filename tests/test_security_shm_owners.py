"""Triton system shared memory next to strangers: a region belongs to the user that registered it.

Another local user cannot see it in status, use it, unregister it (by name or all at once) or
replace it under the same name, and cannot fill the daemon's table (per-user quota).  Inputs read
from a region are bounded by the request limits before anything is read.  The second user runs a
stdlib HTTP client as ``nobody`` (``su``); the tests run as root in CI.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm

from edge_server.shm import DEFAULT_MAX_REGIONS_PER_USER
from tests.daemon import build_repository, stop_daemon
from tests.kserve_daemon import KServeDaemon, start_kserve_daemon

KEY = f"/edge-owner-test-{os.getpid()}-"
needs_nobody = pytest.mark.skipif(
    os.getuid() != 0 or not shutil.which("su"), reason="needs root to run a client as nobody"
)

CLIENT = r"""
import http.client, json, sys
port, ops = int(sys.argv[1]), json.loads(sys.argv[2])
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
out = []
for method, path, body in ops:
    conn.request(method, path, json.dumps(body).encode() if body is not None else None)
    r = conn.getresponse()
    out.append([r.status, r.read().decode()])
print(json.dumps(out))
"""


def as_nobody(port: int, ops: list[tuple[str, str, Any]]) -> list[list[Any]]:
    """Each (method, path, JSON body) sent as uid nobody over one connection: [[status, text], ...]."""
    command = ["/usr/bin/python3", "-c", CLIENT, str(port), json.dumps(ops)]
    done = subprocess.run(
        ["su", "nobody", "-s", "/bin/sh", "-c", " ".join(f"'{part}'" for part in command)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout)


def as_me(port: int, ops: list[tuple[str, str, Any]]) -> list[list[Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    out = []
    try:
        for method, path, body in ops:
            conn.request(method, path, json.dumps(body).encode() if body is not None else None)
            response = conn.getresponse()
            out.append([response.status, response.read().decode()])
    finally:
        conn.close()
    return out


def shm_path(suffix: str) -> str:
    return "/dev/shm/" + (KEY + suffix).lstrip("/")


@pytest.fixture
def segments() -> Iterator[list[object]]:
    handles: list[object] = []
    yield handles
    for handle in handles:
        shm.destroy_shared_memory_region(handle)


def segment(handles: list[object], suffix: str, size: int, mode: int = 0o666) -> object:
    handle = shm.create_shared_memory_region(suffix, KEY + suffix, size)
    handles.append(handle)
    os.chmod(shm_path(suffix), mode)  # so that nobody could open it itself: only ownership stops it
    return handle


def register(name: str, suffix: str, size: int) -> tuple[str, str, Any]:
    body = {"key": KEY + suffix, "offset": 0, "byte_size": size}
    return ("POST", f"/v2/systemsharedmemory/region/{name}/register", body)


STATUS = ("GET", "/v2/systemsharedmemory/status", None)
UNREGISTER_ALL = ("POST", "/v2/systemsharedmemory/unregister", {})
INPUT = {"name": "INPUT0", "shape": [4], "datatype": "FP32"}


def infer_from(name: str) -> tuple[str, str, Any]:
    ref = {"shared_memory_region": name, "shared_memory_byte_size": 16}
    return ("POST", "/v2/models/identity/infer", {"inputs": [dict(INPUT, parameters=ref)]})


def infer_into(name: str) -> tuple[str, str, Any]:
    ref = {"shared_memory_region": name, "shared_memory_byte_size": 16}
    body = {"inputs": [dict(INPUT, data=[9, 9, 9, 9])], "outputs": [{"name": "OUTPUT0", "parameters": ref}]}
    return ("POST", "/v2/models/identity/infer", body)


@needs_nobody
def test_another_user_cannot_see_use_unregister_or_replace_a_region(
    kserve: KServeDaemon, segments: list[object]
) -> None:
    camera = segment(segments, "camera", 16)
    shm.set_shared_memory_region(camera, [np.arange(4, dtype=np.float32)])
    theirs = segment(segments, "theirs", 16)
    shm.set_shared_memory_region(theirs, [np.full(4, 7, dtype=np.float32)])
    port = kserve.http_port
    assert as_me(port, [register("cam", "camera", 16)])[0][0] == 200
    try:
        seen = as_nobody(
            port,
            [
                STATUS,
                ("GET", "/v2/systemsharedmemory/region/cam/status", None),
                infer_from("cam"),
                infer_into("cam"),
                ("POST", "/v2/systemsharedmemory/region/cam/unregister", {}),
                UNREGISTER_ALL,
                register("cam", "theirs", 16),  # its own region under the same name: its own
                infer_from("cam"),  # reads its own segment
                UNREGISTER_ALL,
            ],
        )
        assert seen[0] == [200, "[]"]
        assert seen[1][0] == 400 and "SHM_NOT_REGISTERED" in seen[1][1]
        assert seen[2][0] == 400 and "SHM_NOT_REGISTERED" in seen[2][1]
        assert seen[3][0] == 400 and "SHM_NOT_REGISTERED" in seen[3][1]
        assert seen[6][0] == 200, seen[6]
        assert json.loads(seen[7][1])["outputs"][0]["data"] == [7, 7, 7, 7]
        mine = as_me(port, [STATUS, infer_from("cam"), infer_into("cam")])
        assert [r["name"] for r in json.loads(mine[0][1])] == ["cam"]  # still there, still mine
        assert json.loads(mine[1][1])["outputs"][0]["data"] == [0, 1, 2, 3]
        assert mine[2][0] == 200
        assert shm.get_contents_as_numpy(camera, np.float32, [4]).tolist() == [9, 9, 9, 9]
        assert shm.get_contents_as_numpy(theirs, np.float32, [4]).tolist() == [7, 7, 7, 7]
    finally:
        as_me(port, [UNREGISTER_ALL])


@needs_nobody
def test_one_user_cannot_fill_the_table(kserve: KServeDaemon, segments: list[object]) -> None:
    segment(segments, "many", 16)
    port = kserve.http_port
    count = DEFAULT_MAX_REGIONS_PER_USER + 1
    seen = as_nobody(port, [register(f"r{i}", "many", 16) for i in range(count)] + [UNREGISTER_ALL])
    assert [s[0] for s in seen[:-2]] == [200] * DEFAULT_MAX_REGIONS_PER_USER
    assert seen[-2][0] == 400 and "regions per user" in seen[-2][1]
    try:
        assert as_me(port, [register("mine", "many", 16)])[0][0] == 200
    finally:
        as_me(port, [UNREGISTER_ALL])


def test_one_user_is_one_owner_over_http_and_grpc(kserve: KServeDaemon, segments: list[object]) -> None:
    """Same user over gRPC and HTTP: one owner, so unregister-all drops both (Triton's behaviour)."""
    segment(segments, "both", 16)
    http = httpclient.InferenceServerClient(kserve.http_url)
    grpc = grpcclient.InferenceServerClient(kserve.grpc_url)
    try:
        http.register_system_shared_memory("h", KEY + "both", 16)
        grpc.register_system_shared_memory("g", KEY + "both", 16)
        assert sorted(r["name"] for r in http.get_system_shared_memory_status()) == ["g", "h"]
        grpc.unregister_system_shared_memory()
        assert http.get_system_shared_memory_status() == []
    finally:
        http.close()
        grpc.close()


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_a_sparse_segment_named_as_an_input_is_not_read_whole(kserve: KServeDaemon) -> None:
    big = 1536 << 20
    fd = os.open(shm_path("sparse"), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, big)  # costs nobody anything until it is read
        port = kserve.http_port
        assert as_me(port, [register("sparse", "sparse", big)])[0][0] == 200
        before = peak_rss(kserve.daemon.pid)
        ref = {"shared_memory_region": "sparse", "shared_memory_byte_size": big}
        seen = as_me(port, [("POST", "/v2/models/identity/infer", {"inputs": [dict(INPUT, parameters=ref)]})])
        assert seen[0][0] == 400 and "Expected 16, got" in seen[0][1], seen
        ref = {"shared_memory_region": "sparse", "shared_memory_byte_size": big}
        bytes_input = {"name": "INPUT0", "shape": [1], "datatype": "BYTES", "parameters": ref}
        seen += as_me(port, [("POST", "/v2/models/identity/infer", {"inputs": [bytes_input]})])
        assert seen[1][0] in (400, 413) and "limit" in seen[1][1], seen
        # a shape that matches the span is still held to the request limit before anything is read
        whole = dict(INPUT, shape=[big // 4], parameters=ref)
        seen += as_me(port, [("POST", "/v2/models/identity/infer", {"inputs": [whole]})])
        assert seen[2][0] == 413 and "at most" in seen[2][1], seen
        assert peak_rss(kserve.daemon.pid) - before < 256 << 20
    finally:
        as_me(kserve.http_port, [UNREGISTER_ALL])
        os.close(fd)
        os.unlink(shm_path("sparse"))


def test_status_with_client_shm_off_is_an_empty_list(tmp_path: Path) -> None:
    # its own repository: stopping a daemon opens the gate FIFO of the repository it served
    server = start_kserve_daemon(tmp_path, build_repository(tmp_path), "noshm.sock")
    try:
        c = httpclient.InferenceServerClient(server.http_url)
        try:
            assert c.get_system_shared_memory_status() == []
        finally:
            c.close()
    finally:
        assert stop_daemon(server.daemon) == 0


def test_unregistering_during_an_inference_keeps_the_region_until_it_ends(
    kserve: KServeDaemon, segments: list[object]
) -> None:
    """As in Triton: the region stays listed (and receives the output) until the inference that writes
    into it is done; only then is it gone."""
    import threading

    gate = kserve.daemon.gate
    assert gate is not None
    out = segment(segments, "held", 16)
    port = kserve.http_port
    assert as_me(port, [register("held", "held", 16)])[0][0] == 200
    ref = {"shared_memory_region": "held", "shared_memory_byte_size": 16}
    body = {"inputs": [dict(INPUT, data=[5, 6, 7, 8])], "outputs": [{"name": "OUTPUT0", "parameters": ref}]}
    answer: list[list[Any]] = []
    worker = threading.Thread(
        target=lambda: answer.extend(as_me(port, [("POST", "/v2/models/gate/infer", body)]))
    )
    worker.start()
    try:
        gate.wait_started()
        during = as_me(port, [("POST", "/v2/systemsharedmemory/region/held/unregister", {}), STATUS])
        assert during[0][0] == 200
        assert [r["name"] for r in json.loads(during[1][1])] == ["held"]  # still listed: in use
        refused = as_me(port, [infer_into("held")])  # but no new request may start using it
        assert refused[0][0] == 400 and "SHM_NOT_REGISTERED" in refused[0][1]
    finally:
        gate.release(1)
        worker.join()
        gate.settle()
    assert answer[0][0] == 200, answer
    assert shm.get_contents_as_numpy(out, np.float32, [4]).tolist() == [5, 6, 7, 8]
    assert as_me(port, [STATUS])[0] == [200, "[]"]


def test_a_requests_inputs_from_shared_memory_share_one_budget() -> None:
    from edge_server.errors import MessageTooLarge
    from edge_server.kserve.shm import InputBudget

    budget = InputBudget(100)
    budget.take(60, "input 'A'")
    with pytest.raises(MessageTooLarge, match="would take 120 bytes; this server takes at most 100"):
        budget.take(60, "input 'B'")
    budget.take(40, "input 'C'")
