"""Fuzzing the IPC header and frame decoding: every malformed message gets a stable error code.

Two layers, both bounded in time: the decoding functions the frontend calls (thousands of examples,
no sockets), then a few hundred hostile messages through the real daemon, which must stay up.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_server.client import Client
from edge_server.errors import EdgeServerError
from edge_server.ipc import handlers, protocol
from edge_server.shm import Owner, Registry
from tests.daemon import Daemon

# Every code the daemon may answer a malformed request with (the stable ones of docs/protocol.md).
STABLE = {
    "MALFORMED_MESSAGE",
    "UNSUPPORTED_VERSION",
    "UNKNOWN_OP",
    "TENSOR_SIZE_MISMATCH",
    "MESSAGE_TOO_LARGE",
    "SHM_NOT_REGISTERED",
    "SHM_OUT_OF_BOUNDS",
    "SHM_NAME_REJECTED",
    "SHM_UNAVAILABLE",
    "INVALID_ARGUMENT",
    "MODEL_NOT_FOUND",
    "MODEL_NOT_READY",
    "PERMISSION_DENIED",
    "EXECUTION_FAILED",
}

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=20),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
tensor_desc = st.fixed_dictionaries(
    {},
    optional={
        "name": st.one_of(st.just("INPUT0"), st.text(max_size=8), st.integers(-(2**63), 2**64 - 1)),
        "datatype": st.one_of(st.sampled_from(sorted(protocol.WIRE_DTYPES)), values),
        "shape": st.one_of(st.lists(st.integers(min_value=-2, max_value=2**64 - 1), max_size=40), values),
        "frame": st.one_of(st.integers(min_value=-1, max_value=3), values),
        "shm": st.one_of(
            values,
            st.fixed_dictionaries(
                {
                    "region": st.text(max_size=8),
                    "offset": st.integers(-(2**63), 2**64 - 1),
                    "byte_size": st.integers(-(2**63), 2**64 - 1),
                }
            ),
        ),
    },
)
headers = st.fixed_dictionaries(
    {},
    optional={
        "v": st.one_of(st.just(1), values),
        "id": values,
        "op": st.one_of(st.sampled_from(sorted(protocol.OPS)), values),
        "model": st.one_of(st.just("identity"), values),
        "inputs": st.one_of(st.lists(tensor_desc, max_size=3), values),
        "outputs": st.one_of(
            st.lists(st.dictionaries(st.sampled_from(["name", "shm"]), values), max_size=3), values
        ),
        "priority": values,
        "timeout_us": values,
        "parameters": values,
        "sequence_id": values,
        "sequence_start": values,
    },
)
frames = st.lists(st.binary(max_size=64), max_size=4)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(header=headers, tensors=frames)
def test_decoding_any_header_raises_only_stable_errors(header: dict[str, Any], tensors: list[bytes]) -> None:
    raw = msgpack.packb(header, use_bin_type=True)
    try:
        decoded = protocol.unpack(raw)
        protocol.check_version(decoded)
        handlers.decode_infer(decoded, [zmq.Frame(f) for f in tensors], Registry().client(Owner(0)))
    except EdgeServerError as exc:
        assert exc.code in STABLE, (exc.code, exc.message)


@settings(max_examples=800, deadline=None)
@given(blob=st.binary(max_size=256))
def test_unpacking_garbage_raises_only_malformed(blob: bytes) -> None:
    try:
        protocol.unpack(blob)
    except EdgeServerError as exc:
        assert exc.code == "MALFORMED_MESSAGE"


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(header=headers, tensors=frames)
def test_the_daemon_answers_hostile_messages_with_stable_codes(
    daemon: Daemon, header: dict[str, Any], tensors: list[bytes]
) -> None:
    if header.get("op") in ("load", "reload", "unload", "bye"):
        header["op"] = "live"  # the daemon's user may do those; they are not what is fuzzed here
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(daemon.address)
        sock.send_multipart([msgpack.packb(header, use_bin_type=True), *tensors])
        if header.get("op") == "stream" and sock.poll(5000):  # may answer many times: one is enough
            reply = protocol.unpack(sock.recv_multipart()[0])
        else:
            assert sock.poll(10_000), "the daemon did not answer"
            reply = protocol.unpack(sock.recv_multipart()[0])
    finally:
        sock.close(0)
    if not reply.get("ok"):
        assert reply["error"]["code"] in STABLE, reply


def test_the_daemon_is_alive_after_the_fuzzing(daemon: Daemon) -> None:
    assert daemon.proc is not None and daemon.proc.poll() is None
    with Client(daemon.address, timeout=10) as client:
        x = np.arange(16, dtype=np.float32)
        np.testing.assert_array_equal(client.infer("identity", {"INPUT0": x})["OUTPUT0"], x)
