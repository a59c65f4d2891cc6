"""Triton's system shared-memory extension over HTTP and gRPC, with tritonclient.utils.shared_memory,
against the real daemon: inputs and outputs through regions, status/unregister, bounds, a shrinking
segment, the access rule (a client of another uid), and the extension off by default."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from edge_server.kserve.shm import Peer, may_access, peer_uid
from tests.daemon import stop_daemon
from tests.kserve_daemon import KServeDaemon, ort_run, start_kserve_daemon

KEY_PREFIX = f"/edge-kserve-test-{os.getpid()}-"


@pytest.fixture
def regions() -> Iterator[list[object]]:
    handles: list[object] = []
    yield handles
    for handle in handles:
        shm.destroy_shared_memory_region(handle)


def region(handles: list[object], name: str, size: int) -> object:
    handle = shm.create_shared_memory_region(name, KEY_PREFIX + name, size)
    handles.append(handle)
    return handle


@pytest.fixture(params=["http", "grpc"])
def client(request: pytest.FixtureRequest, kserve: KServeDaemon) -> Iterator[object]:
    if request.param == "http":
        c: object = httpclient.InferenceServerClient(kserve.http_url)
    else:
        c = grpcclient.InferenceServerClient(kserve.grpc_url)
    yield c
    c.unregister_system_shared_memory()  # type: ignore[attr-defined]
    c.close()  # type: ignore[attr-defined]


def module_of(client: object):  # noqa: ANN201 - the tritonclient module matching the client
    return httpclient if isinstance(client, httpclient.InferenceServerClient) else grpcclient


def test_inputs_and_outputs_through_regions(
    client: object, regions: list[object], ipc_repository: Path
) -> None:
    mod = module_of(client)
    image = np.random.default_rng(5).random((2, 1, 8, 8), dtype=np.float32)
    expected = ort_run(ipc_repository, "digits", {"image": image})[0]
    handle_in = region(regions, "in", image.nbytes + 64)
    handle_out = region(regions, "out", expected.nbytes + 64)
    shm.set_shared_memory_region(handle_in, [image], offset=64)
    client.register_system_shared_memory("in", KEY_PREFIX + "in", image.nbytes + 64)  # type: ignore[attr-defined]
    client.register_system_shared_memory("out", KEY_PREFIX + "out", expected.nbytes, offset=64)  # type: ignore[attr-defined]
    tensor = mod.InferInput("image", list(image.shape), "FP32")
    tensor.set_shared_memory("in", image.nbytes, offset=64)
    wanted = mod.InferRequestedOutput("probabilities")
    wanted.set_shared_memory("out", expected.nbytes)
    result = client.infer("digits", [tensor], outputs=[wanted])  # type: ignore[attr-defined]
    output = result.get_output("probabilities")
    shape = list(output["shape"] if isinstance(output, dict) else output.shape)
    assert [int(d) for d in shape] == list(expected.shape)
    got = shm.get_contents_as_numpy(handle_out, np.float32, expected.shape, offset=64)
    np.testing.assert_allclose(got, expected, rtol=1e-6)

    status = client.get_system_shared_memory_status()  # type: ignore[attr-defined]
    names = {r["name"] for r in status} if isinstance(status, list) else set(status.regions)
    assert names == {"in", "out"}
    client.unregister_system_shared_memory("in")  # type: ignore[attr-defined]
    with pytest.raises(InferenceServerException, match="Unable to find shared memory region"):
        client.infer("digits", [tensor])  # type: ignore[attr-defined]


def test_registration_and_reference_bounds(client: object, regions: list[object]) -> None:
    mod = module_of(client)
    region(regions, "small", 16)
    too_big = "failed to register shared memory region 'small': invalid args .cannot register bytes 0..32"
    with pytest.raises(InferenceServerException, match=too_big):
        client.register_system_shared_memory("small", KEY_PREFIX + "small", 32)  # type: ignore[attr-defined]
    with pytest.raises(InferenceServerException, match="Unable to open shared memory region: '.*missing'"):
        client.register_system_shared_memory("gone", KEY_PREFIX + "missing", 16)  # type: ignore[attr-defined]
    for key in ("/../etc/passwd", "/", "///"):  # Triton's text for a key it refuses
        with pytest.raises(InferenceServerException, match=f"region 'evil' - invalid shm key '{key}'"):
            client.register_system_shared_memory("evil", key, 16)  # type: ignore[attr-defined]
    reserved = "as the key contains the reserved prefix 'triton_python_backend_shm_region_'"
    with pytest.raises(InferenceServerException, match=reserved):
        client.register_system_shared_memory("r", "/triton_python_backend_shm_region_x", 16)  # type: ignore[attr-defined]
    client.register_system_shared_memory("small", KEY_PREFIX + "small", 16)  # type: ignore[attr-defined]
    with pytest.raises(InferenceServerException, match="already in manager"):
        client.register_system_shared_memory("small", KEY_PREFIX + "small", 16)  # type: ignore[attr-defined]
    tensor = mod.InferInput("INPUT0", [8], "FP32")  # 32 bytes from a 16-byte region
    tensor.set_shared_memory("small", 32)
    with pytest.raises(
        InferenceServerException, match="Invalid offset \\+ byte size for shared memory region: 'small'"
    ):
        client.infer("identity", [tensor])  # type: ignore[attr-defined]
    tensor = mod.InferInput("INPUT0", [2], "FP32")
    tensor.set_shared_memory("small", 8, offset=16)  # at or past the end: Triton's text for the offset
    with pytest.raises(InferenceServerException, match="Invalid offset for shared memory region: 'small'"):
        client.infer("identity", [tensor])  # type: ignore[attr-defined]
    tensor = mod.InferInput("INPUT0", [2], "FP32")
    tensor.set_shared_memory("small", 8, offset=12)
    with pytest.raises(
        InferenceServerException, match="Invalid offset \\+ byte size for shared memory region"
    ):
        client.infer("identity", [tensor])  # type: ignore[attr-defined]
    tensor = mod.InferInput("INPUT0", [4], "FP32")
    tensor.set_shared_memory("small", 16)
    wanted = mod.InferRequestedOutput("OUTPUT0")
    wanted.set_shared_memory("small", 8)  # too small for the 16-byte output
    with pytest.raises(
        InferenceServerException, match="the output has 16 bytes, the shared-memory span holds 8"
    ):
        client.infer("identity", [tensor], outputs=[wanted])  # type: ignore[attr-defined]


def test_a_shrunk_segment_is_an_error_not_a_crash(client: object, regions: list[object]) -> None:
    mod = module_of(client)
    region(regions, "shrink", 4096)
    client.register_system_shared_memory("shrink", KEY_PREFIX + "shrink", 4096)  # type: ignore[attr-defined]
    os.truncate("/dev/shm/" + (KEY_PREFIX + "shrink").lstrip("/"), 16)
    tensor = mod.InferInput("INPUT0", [1024], "FP32")
    tensor.set_shared_memory("shrink", 4096)
    with pytest.raises(InferenceServerException, match="now holds 16"):
        client.infer("identity", [tensor])  # type: ignore[attr-defined]
    assert client.is_server_live()  # type: ignore[attr-defined]


def test_cuda_shared_memory_register_is_refused(kserve: KServeDaemon) -> None:
    c = httpclient.InferenceServerClient(kserve.http_url)
    try:
        with pytest.raises(InferenceServerException, match="CUDA shared memory is not supported"):
            c.register_cuda_shared_memory("x", b"handle", 0, 16)
    finally:
        c.close()


# -- the access rule --------------------------------------------------------------------------------


def test_peer_uid_finds_the_client_socket_in_proc_net_tcp() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, address = server.accept()
        try:
            peer = Peer(address[0], address[1], server.getsockname()[1])
            assert peer_uid(peer) == os.getuid()
            assert peer_uid(Peer(address[0], address[1], server.getsockname()[1] + 1)) is None
            assert peer_uid(Peer("10.255.255.1", address[1], server.getsockname()[1])) is None
        finally:
            accepted.close()
            client.close()


def test_may_access_follows_owner_group_other_bits() -> None:
    def st(mode: int, uid: int = 1000, gid: int = 1000) -> os.stat_result:
        return os.stat_result((0o100000 | mode, 0, 0, 1, uid, gid, 0, 0, 0, 0))

    assert may_access(0, st(0o000), write=True)  # root
    assert may_access(1000, st(0o600), write=True)
    assert not may_access(1000, st(0o400), write=True)
    assert not may_access(65534, st(0o600), write=False)  # nobody: other bits
    assert may_access(65534, st(0o604), write=False)
    assert not may_access(65534, st(0o604), write=True)


NOBODY_CLIENT = r"""
import http.client, json, sys
port, key, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
def post(path, body):
    conn.request("POST", path, json.dumps(body).encode())
    r = conn.getresponse()
    return r.status, r.read().decode()
REF = {"shared_memory_region": "nb", "shared_memory_byte_size": 16}
INPUT = {"name": "INPUT0", "shape": [4], "datatype": "FP32"}
REGISTER = {"key": key, "offset": 0, "byte_size": 16}
if mode == "control":
    print(json.dumps({"unload": post("/v2/repository/models/identity/unload", {})}))
    sys.exit(0)
out = {"register": post("/v2/systemsharedmemory/region/nb/register", REGISTER)}
if mode == "use":
    out["read"] = post("/v2/models/identity/infer", {"inputs": [dict(INPUT, parameters=REF)]})
    out["write"] = post(
        "/v2/models/identity/infer",
        {"inputs": [dict(INPUT, data=[1, 2, 3, 4])], "outputs": [{"name": "OUTPUT0", "parameters": REF}]},
    )
    post("/v2/systemsharedmemory/region/nb/unregister", {})
print(json.dumps(out))
"""


@pytest.mark.skipif(os.getuid() != 0 or not shutil.which("su"), reason="needs root to run a client as nobody")
def test_a_client_of_another_user_only_gets_what_it_could_open_itself(
    kserve: KServeDaemon, regions: list[object]
) -> None:
    handle = region(regions, "private", 16)
    shm.set_shared_memory_region(handle, [np.arange(4, dtype=np.float32)])
    path = "/dev/shm/" + (KEY_PREFIX + "private").lstrip("/")

    def as_nobody(mode: str) -> dict[str, list[object]]:
        command = [
            "/usr/bin/python3",
            "-c",
            NOBODY_CLIENT,
            str(kserve.http_port),
            KEY_PREFIX + "private",
            mode,
        ]
        done = subprocess.run(
            ["su", "nobody", "-s", "/bin/sh", "-c", " ".join(f"'{part}'" for part in command)],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return json.loads(done.stdout)

    os.chmod(path, 0o600)  # root's own segment: nobody may not touch it
    denied = as_nobody("register")
    assert denied["register"][0] == 400 and "permission denied" in denied["register"][1]
    os.chmod(path, 0o604)  # others may read it, not write it
    used = as_nobody("use")
    assert used["register"][0] == 200
    assert used["read"][0] == 200 and json.loads(used["read"][1])["outputs"][0]["data"] == [0, 1, 2, 3]
    assert used["write"][0] == 400 and "may not write" in used["write"][1]
    assert shm.get_contents_as_numpy(handle, np.float32, [4]).tolist() == [0, 1, 2, 3]  # untouched
    control = as_nobody("control")  # repository control is for the daemon's user and group, as over IPC
    assert control["unload"][0] == 403 and "PERMISSION_DENIED" in control["unload"][1]
    c = httpclient.InferenceServerClient(kserve.http_url)
    try:
        assert c.is_model_ready("identity")
    finally:
        c.close()


def test_the_extension_is_off_by_default(ipc_root: Path, ipc_repository: Path) -> None:
    server = start_kserve_daemon(ipc_root, ipc_repository, "noshm.sock")
    try:
        c = httpclient.InferenceServerClient(server.http_url)
        try:
            assert "system_shared_memory" not in c.get_server_metadata()["extensions"]
            with pytest.raises(InferenceServerException, match="--allow-client-shm=true"):
                c.register_system_shared_memory("x", KEY_PREFIX + "x", 16)
            tensor = httpclient.InferInput("INPUT0", [4], "FP32")
            tensor.set_shared_memory("x", 16)
            with pytest.raises(InferenceServerException, match="--allow-client-shm=true"):
                c.infer("identity", [tensor])
        finally:
            c.close()
    finally:
        assert stop_daemon(server.daemon) == 0


def test_the_client_is_the_socket_not_a_forwarded_header(kserve: KServeDaemon, regions: list[object]) -> None:
    """X-Forwarded-For does not change whose connection it is: the uid comes from the socket itself, and
    is looked up once per connection (the same connection registers, uses and unregisters)."""
    region(regions, "forwarded", 64)
    body = json.dumps({"key": KEY_PREFIX + "forwarded", "offset": 0, "byte_size": 64})
    conn = http.client.HTTPConnection("127.0.0.1", kserve.http_port, timeout=10)
    try:
        for path, payload in (
            ("/v2/systemsharedmemory/region/fwd/register", body),
            ("/v2/systemsharedmemory/region/fwd/status", ""),
            ("/v2/systemsharedmemory/region/fwd/unregister", ""),
        ):
            method = "GET" if path.endswith("status") else "POST"
            conn.request(method, path, payload, {"X-Forwarded-For": "203.0.113.9"})
            response = conn.getresponse()
            text = response.read()
            assert response.status == 200, text
    finally:
        conn.close()
