"""A sequence-batched model whose instance fails is restarted, as every other model is (issue 24, defect 3).

``dyna`` (Triton's simple_dyna_sequence, a Python model) runs in its own process here; a request with
INPUT 13 kills that process.  The request fails with INSTANCE_FAILED, and the instance pool that the
dynamic and the sequence batcher share replaces the instance after its back-off: a new sequence is
answered again.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge_server import Server
from edge_server.errors import EdgeServerError
from tests.sequence_models import DYNA_CONFIG, DYNA_MODEL, write_model

ISOLATED = '\nparameters [ { key: "isolation", value: { string_value: "process" } } ]\n'
CRASHING = DYNA_MODEL.replace(
    '            value = int(get("INPUT")[0, 0])\n',
    '            value = int(get("INPUT")[0, 0])\n            if value == 13:\n                os._exit(1)\n',
).replace("import numpy as np\n", "import os\n\nimport numpy as np\n", 1)


def _step(server: Server, corrid: int, value: int, *, start: bool = False, end: bool = False) -> int:
    out = server.infer(
        "dyna",
        {"INPUT": np.array([[value]], np.int32)},
        correlation_id=corrid,
        sequence_start=start,
        sequence_end=end,
    )["OUTPUT"]
    return int(out[0, 0])


def test_a_failed_sequence_instance_is_restarted(tmp_path: Path) -> None:
    assert "os._exit(1)" in CRASHING
    write_model(tmp_path, "dyna", DYNA_CONFIG + ISOLATED, python=CRASHING)
    with Server(tmp_path) as server:
        assert _step(server, 1, 5, start=True) == 5
        with pytest.raises(EdgeServerError) as info:
            _step(server, 1, 13)
        assert info.value.code == "INSTANCE_FAILED", info.value
        # The only instance restarts after its back-off; a request sent meanwhile waits for it.
        assert _step(server, 2, 4, start=True) == 4
        assert _step(server, 2, 3, end=True) == 7 + 2
