"""Reaching the daemon is not controlling it: one rule for load, unload and settings on every frontend.

Control (load, unload, reload, log and trace settings) is for root, the daemon's user and
``--operator-group``; a client in the daemon's group (as every client of the installed service is, to
reach the socket) may infer, never control.  The clients run as other uids (see ``tests/users.py``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.daemon import build_repository, start_daemon, stop_daemon
from tests.kserve_daemon import KServeDaemon, start_kserve_daemon
from tests.users import NOBODY, STRANGER, needs_root, open_socket, public_directory, run_as

pytestmark = needs_root

# Tries every control operation over IPC, HTTP and gRPC; prints what each answered.
CLIENT = r"""
import http.client, json, sys
address, http_port, grpc_port = sys.argv[1], int(sys.argv[2]), sys.argv[3]
from edge_server.client import Client
from edge_server.errors import EdgeServerError
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException
seen = {}
with Client(address, timeout=30) as client:
    try:
        client.load_model("identity")
        seen["ipc_load"] = "ok"
    except EdgeServerError as exc:
        seen["ipc_load"] = exc.code
    seen["ipc_infer_ready"] = client.model_ready("identity")
conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=30)
def post(path, body):
    conn.request("POST", path, json.dumps(body).encode())
    reply = conn.getresponse()
    return [reply.status, reply.read().decode()]
seen["http_logging"] = post("/v2/logging", {"log_error": True})[0]
seen["http_trace"] = post("/v2/trace/setting", {"trace_level": ["OFF"]})[0]
seen["http_model_trace"] = post("/v2/models/identity/trace/setting", {"trace_level": ["OFF"]})[0]
seen["http_load"] = post("/v2/repository/models/identity/load", {})[0]
conn.request("GET", "/v2/logging")
reply = conn.getresponse()
seen["http_logging_get"] = [reply.status, json.loads(reply.read())["log_error"]]
grpc = grpcclient.InferenceServerClient("127.0.0.1:" + grpc_port)
for name, call in (
    ("grpc_logging", lambda: grpc.update_log_settings({"log_error": True})),
    ("grpc_trace", lambda: grpc.update_trace_settings(settings={"trace_level": ["OFF"]})),
    ("grpc_load", lambda: grpc.load_model("identity")),
):
    try:
        call()
        seen[name] = "OK"
    except InferenceServerException as exc:
        seen[name] = exc.status()
seen["grpc_logging_get"] = grpc.get_log_settings(as_json=True)["settings"]["log_error"]["bool_param"]
grpc.close()
print(json.dumps(seen))
"""

DENIED = {
    "ipc_load": "PERMISSION_DENIED",
    "ipc_infer_ready": True,
    "http_logging": 403,
    "http_trace": 403,
    "http_model_trace": 403,
    "http_load": 403,
    "http_logging_get": [200, True],
    "grpc_logging": "StatusCode.PERMISSION_DENIED",
    "grpc_trace": "StatusCode.PERMISSION_DENIED",
    "grpc_load": "StatusCode.PERMISSION_DENIED",
    "grpc_logging_get": True,
}
ALLOWED = {
    "ipc_load": "ok",
    "ipc_infer_ready": True,
    "http_logging": 200,
    "http_trace": 200,
    "http_model_trace": 200,
    "http_load": 200,
    "http_logging_get": [200, True],
    "grpc_logging": "OK",
    "grpc_trace": "OK",
    "grpc_load": "OK",
    "grpc_logging_get": True,
}


@pytest.fixture(scope="module")
def operated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KServeDaemon]:
    """A daemon (root) whose socket every user reaches, with ``nogroup`` as its operator group."""
    with public_directory() as root:
        repo = build_repository(root)
        server = start_kserve_daemon(root, repo, "c.sock", "--operator-group", "nogroup")
        open_socket(server.daemon.address)
        try:
            yield server
        finally:
            assert stop_daemon(server.daemon) == 0, server.daemon.log()


def control_as(server: KServeDaemon, uid: int, gid: int, groups: list[int]) -> dict[str, object]:
    args = (server.daemon.address, str(server.http_port), str(server.grpc_port))
    seen: dict[str, object] = run_as(uid, gid, groups, CLIENT, *args)
    return seen


def test_the_daemons_group_may_infer_but_not_control(operated: KServeDaemon) -> None:
    # The daemon runs as root (gid 0): a client whose process carries group 0, as every client of the
    # installed service carries the daemon's group to reach its socket.
    assert os.getegid() == 0
    assert control_as(operated, STRANGER, 0, [0]) == DENIED


def test_a_stranger_may_not_change_the_log_settings(operated: KServeDaemon) -> None:
    assert control_as(operated, STRANGER, STRANGER, []) == DENIED


def test_the_operator_group_may_control_on_every_frontend(operated: KServeDaemon) -> None:
    # nobody's primary group in the user database is nogroup, the operator group here.
    assert control_as(operated, NOBODY, NOBODY, []) == ALLOWED


def test_without_an_operator_group_only_root_and_the_daemons_user_control() -> None:
    with public_directory() as root:
        proc = start_daemon(root, build_repository(root), "n.sock")
        open_socket(proc.address)
        try:
            script = CLIENT.split("conn = http.client")[0] + "print(json.dumps(seen))\n"
            seen = run_as(NOBODY, NOBODY, [], script, proc.address, "0", "0")
            assert seen == {"ipc_load": "PERMISSION_DENIED", "ipc_infer_ready": True}
        finally:
            assert stop_daemon(proc) == 0, proc.log()
