"""Which NVIDIA GPUs this machine has, from device nodes alone (no CUDA import).

A discrete GPU appears as ``/dev/nvidia<N>``; a Jetson's integrated GPU as ``/dev/nvhost-ctrl-gpu``
(or ``/dev/nvgpu/igpu0`` on newer L4T) and is always GPU 0.  ``root`` lets tests point at a fake tree.
"""

from __future__ import annotations

import re
from pathlib import Path

_DISCRETE = re.compile(r"nvidia(\d+)")


def gpu_ids(root: Path = Path("/")) -> tuple[int, ...]:
    """The GPU ids an ``instance_group`` may name on this machine, ascending; () when there is none."""
    dev = root / "dev"
    ids: set[int] = set()
    try:
        for entry in dev.iterdir():
            match = _DISCRETE.fullmatch(entry.name)
            if match:
                ids.add(int(match[1]))
    except OSError:
        return ()
    if (dev / "nvhost-ctrl-gpu").exists() or (dev / "nvgpu" / "igpu0").exists():
        ids.add(0)
    return tuple(sorted(ids))
