"""Triton's load-time config override (JSON) in the in-process server: it replaces config.pbtxt until
the model is loaded again without one, survives rescans, and a bad override changes nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from edge_server import Server
from edge_server.errors import ConfigError


@pytest.fixture
def repo(tmp_path: Path, example_repository: Path) -> Path:
    shutil.copytree(example_repository / "identity", tmp_path / "identity")
    return tmp_path


def test_override_until_loaded_without_one(repo: Path) -> None:
    with Server(repo, model_control_mode="explicit", load_models=["identity"]) as server:
        original = server.model_config("identity").to_triton_dict()
        override = dict(original, parameters={"note": {"string_value": "from the load call"}})
        server.load_model("identity", config_override=json.dumps(override))
        assert server.model_config("identity").parameters == {"note": "from the load call"}
        server.rescan()  # SIGHUP: the override stays
        assert server.model_config("identity").parameters == {"note": "from the load call"}
        with pytest.raises(ConfigError, match="config given at load"):
            server.load_model("identity", config_override='{"max_batch_size": "lots"}')
        assert server.model_config("identity").parameters == {"note": "from the load call"}
        server.load_model("identity")
        assert server.model_config("identity").parameters == {}
