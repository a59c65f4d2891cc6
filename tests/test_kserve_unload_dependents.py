"""Triton's ``unload_dependents``: unloading an ensemble with it unloads the ensemble's members too.

From Triton's QA (L0_lifecycle ``test_ensemble_unload_dependents``): without the flag the members keep
serving; with it (HTTP and gRPC alike) they go, nested ensembles' members included.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.daemon import Daemon, free_port, kserve_flags
from tests.test_ensemble import PIPE, add_ensemble, add_member, ensemble_config, step

pytestmark = pytest.mark.usefixtures("no_leaked_processes")


@pytest.fixture(scope="module")
def ports(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int]]:
    root = tmp_path_factory.mktemp("dependents")
    repo = root / "repo"
    add_member(repo, "scale", scale=2.0, offset=0.0)
    add_member(repo, "shift", scale=1.0, offset=3.0)
    add_member(repo, "alone", scale=1.0, offset=0.0)
    add_ensemble(repo, "pipe", ensemble_config("pipe", PIPE))
    outer = [step("pipe", {"IN": "IN"}, {"OUT": "OUT"})]  # an ensemble of an ensemble
    add_ensemble(repo, "outer", ensemble_config("outer", outer))
    http_port, grpc_port = free_port(), free_port()
    flags = [*kserve_flags(http_port, grpc_port), "--model-control-mode", "explicit"]
    daemon = Daemon(repo, f"ipc://{root}/d.sock", root / "d.log", *flags)
    daemon.start()
    try:
        yield http_port, grpc_port
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_unload_dependents_takes_the_members_along(ports: tuple[int, int]) -> None:
    http = httpclient.InferenceServerClient(f"127.0.0.1:{ports[0]}")
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{ports[1]}")
    try:
        http.load_model("alone")
        http.load_model("pipe")  # loads its members, as Triton's explicit mode does
        assert all(http.is_model_ready(m) for m in ("pipe", "scale", "shift"))
        http.unload_model("pipe")  # the default: the members stay
        assert not http.is_model_ready("pipe")
        assert http.is_model_ready("scale") and http.is_model_ready("shift")
        http.load_model("pipe")
        http.unload_model("pipe", unload_dependents=True)
        assert not any(http.is_model_ready(m) for m in ("pipe", "scale", "shift"))
        assert http.is_model_ready("alone")  # not a member: untouched
        grpc.load_model("outer")  # gRPC, nested: pipe, and pipe's members, go with outer
        assert all(grpc.is_model_ready(m) for m in ("outer", "pipe", "scale", "shift"))
        grpc.unload_model("outer", unload_dependents=True)
        assert not any(grpc.is_model_ready(m) for m in ("outer", "pipe", "scale", "shift"))
        assert grpc.is_model_ready("alone")
    finally:
        http.close()
        grpc.close()
