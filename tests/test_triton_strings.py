"""TYPE_STRING is an object array of bytes at every boundary, through ONNX Runtime and Python models."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from edge_server import Server
from edge_server.client import Client
from edge_server.errors import InvalidArgument
from tests import triton_models
from tests.daemon import Daemon

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

WORDS = ["hello", "wörld", "", "Jetson ünïcode"]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return triton_models.build(tmp_path_factory.mktemp("strings") / "repo")


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[Server]:
    with Server(repository) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    root = tmp_path_factory.mktemp("sock")
    daemon = Daemon(repository, f"ipc://{root}/s.sock", root / "s.log").start()
    try:
        with Client(daemon.address, timeout=30) as c:
            yield c
    finally:
        assert daemon.stop() == 0, daemon.log()


def as_bytes(words: list[str]) -> np.ndarray:
    array = np.empty(len(words), dtype=object)
    array[:] = [w.encode() for w in words]
    return array


def assert_bytes_array(array: np.ndarray, expected: list[bytes]) -> None:
    assert array.dtype == object
    assert [type(x) for x in array.reshape(-1)] == [bytes] * len(expected)
    assert list(array.reshape(-1)) == expected


def direct_exclaimed(repository: Path, words: list[str]) -> list[bytes]:
    """What ONNX Runtime itself answers, given str as its Python API needs."""
    session = ort.InferenceSession(
        str(repository / "strings_onnx" / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    (exclaimed,) = session.run(["EXCLAIMED"], {"TEXT": np.array(words, dtype=object)})
    assert list(exclaimed) == [w + "!" for w in words]
    return [s.encode() for s in exclaimed]


@pytest.mark.parametrize(
    "given",
    [
        pytest.param(lambda: as_bytes(WORDS), id="object-bytes"),
        pytest.param(lambda: np.array(WORDS, dtype=object), id="object-str"),
        pytest.param(lambda: np.array(WORDS), id="unicode"),
    ],
)
def test_onnx_string_model_in_process(server: Server, repository: Path, given) -> None:
    out = server.infer("strings_onnx", {"TEXT": given()})
    assert_bytes_array(out["SAME"], [w.encode() for w in WORDS])  # not "b'hello'"
    assert_bytes_array(out["EXCLAIMED"], direct_exclaimed(repository, WORDS))


def test_onnx_string_model_over_ipc(client: Client, repository: Path) -> None:
    out = client.infer("strings_onnx", {"TEXT": as_bytes(WORDS)})
    assert_bytes_array(out["SAME"], [w.encode() for w in WORDS])
    assert_bytes_array(out["EXCLAIMED"], direct_exclaimed(repository, WORDS))


def test_onnx_string_input_that_is_not_utf8_is_refused(server: Server) -> None:
    with pytest.raises(InvalidArgument, match="not UTF-8"):
        server.infer("strings_onnx", {"TEXT": np.array([b"\xff\xfe"], dtype=object)})


def test_python_model_receives_and_returns_bytes_in_process(server: Server) -> None:
    text = np.array([WORDS], dtype=object)  # str elements: the model must still see bytes
    out = server.infer("upper", {"TEXT": text})
    assert_bytes_array(out["TYPES"], [b"bytes"] * len(WORDS))
    assert_bytes_array(out["UPPER"], [w.upper().encode() for w in WORDS])  # model returned str


def test_python_model_receives_and_returns_bytes_over_ipc(client: Client) -> None:
    text = np.empty((2, 2), dtype=object)
    text[:] = [[b"a", "b\xe9".encode()], [b"", b"xyz"]]
    out = client.infer("upper", {"TEXT": text})
    assert out["UPPER"].shape == (2, 2)
    assert_bytes_array(out["TYPES"], [b"bytes"] * 4)
    assert_bytes_array(out["UPPER"], [b"A", "BÉ".encode(), b"", b"XYZ"])


def test_a_non_string_element_is_refused(server: Server) -> None:
    with pytest.raises(InvalidArgument, match="element 1 is int"):
        server.infer("upper", {"TEXT": np.array([[b"a", 3]], dtype=object)})
