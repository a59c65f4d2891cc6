"""The line each model logs when it is ready: where its instances run, said once per device."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from edge_server import Server
from edge_server.lifecycle import describe_placement

CHAIN = """
name: "chain"
platform: "ensemble"
max_batch_size: 0
input [ { name: "x", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "y", data_type: TYPE_FP32, dims: [ -1 ] } ]
ensemble_scheduling { step [ {
  model_name: "identity"
  model_version: -1
  input_map { key: "INPUT0" value: "x" }
  output_map { key: "OUTPUT0" value: "y" }
} ] }
"""


def test_ready_lines_count_instances_per_device_and_ensembles_name_no_device(
    tmp_path: Path, example_repository: Path, caplog: pytest.LogCaptureFixture
) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(example_repository / "identity", repo / "identity")
    config = repo / "identity" / "config.pbtxt"
    config.write_text(config.read_text().replace("count: 1", "count: 2"))
    (repo / "chain" / "1").mkdir(parents=True)
    (repo / "chain" / "config.pbtxt").write_text(CHAIN)
    with caplog.at_level(logging.INFO, logger="edge_server.lifecycle"), Server(repo):
        pass
    ready = [r.getMessage() for r in caplog.records if " ready" in r.getMessage()]
    assert any(line.startswith("identity v1 ready: 2 instances on cpu, in ") for line in ready), ready
    assert any(line.startswith("chain v1 ready: an ensemble, in ") for line in ready), ready
    assert not [line for line in ready if "on  in" in line or "cpu, cpu" in line], ready


def test_placement_reads_as_counts() -> None:
    assert describe_placement(("cpu",), ensemble=False) == "1 instance on cpu"
    assert describe_placement(("gpu 0", "gpu 0", "dla 0", "dla 1"), ensemble=False) == (
        "4 instances: 2 on gpu 0, 1 on dla 0, 1 on dla 1"
    )
    assert describe_placement((), ensemble=True) == "an ensemble"
