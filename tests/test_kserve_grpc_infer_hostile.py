"""``ModelInfer`` on grpcio's polling thread (kserve/grpc_infer.py) against hostile clients.

The queue counts a call among the frontend's inference calls when it arrives, before its message is
read, and answers it from grpcio's polling thread or a model's instance thread.  Each test is a way a
local client may try to hold that count, the daemon's memory or its threads: the count and the body
budget must come back, the daemon must stay up, and other clients must be served.  They also guard the
coupling to grpcio's private server state: a grpcio that changes it fails here first.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from edge_server.limits import LimitOptions, Limits
from tests.daemon import wait_for
from tests.test_kserve_grpc_infer_queue import in_process, infer, write_repository

pytestmark = pytest.mark.daemon

METHOD = "/inference.GRPCInferenceService/ModelInfer"


def never(stop: threading.Event) -> Iterator[bytes]:
    """A request stream that sends nothing until ``stop``: a call opened, its message never sent."""
    stop.wait()
    yield from ()


def test_a_call_whose_message_never_comes_gives_its_count_back(tmp_path: Path) -> None:
    """Calls that open and never send their message (a slow-loris) are cancelled past the body timeout.

    Before, each held one of the inference count's places for as long as its client liked: 120 of them
    (2 here) refused every other client's inference, on one connection.
    """
    limits = Limits(LimitOptions(body_timeout_s=0.5))
    stop = threading.Event()
    with in_process(write_repository(tmp_path / "repo"), max_workers=4, limits=limits) as frontend:
        with grpc.insecure_channel(f"127.0.0.1:{frontend.port}") as channel:
            call = channel.stream_unary(METHOD)
            hanging = [call.future(never(stop)) for _ in range(2)]
            try:
                for future in hanging:
                    with pytest.raises(grpc.RpcError) as cut:
                        future.result(timeout=30)
                    assert cut.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                    assert "--body-timeout-secs" in (cut.value.details() or "")
            finally:
                stop.set()
        wait_for(lambda: frontend._inference == 0, 30, "the count given back")
        with grpcclient.InferenceServerClient(f"127.0.0.1:{frontend.port}") as client:
            assert np.array_equal(infer(client, "quick", np.ones(2, np.float32)), np.full(2, 2, np.float32))
        assert frontend._inference == 0
