"""``edge-server models`` and ``infer``: ask the running daemon, or load a repository in this process."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edge_server.cli.arguments import RepeatedFlag, UsageError
from edge_server.cli.image_input import CHANNEL_ORDERS, image_tensor
from edge_server.errors import EdgeServerError, InvalidArgument
from edge_server.status_index import index_row

_TARGET_HELP = (
    "Asks the running daemon (found at $EDGE_SERVER_IPC, else /run/edge-server/edge-server.sock, else "
    "the per-user socket); --ipc names it; --model-repository DIR or --local load models in this process."
)


def add_client_parsers(commands: Any) -> None:
    """Register ``models`` and ``infer``."""
    for name, help_text in (
        ("models", "list models, versions and their state"),
        ("infer", "run one request"),
    ):
        sub = commands.add_parser(name, help=help_text, description=_TARGET_HELP)
        sub.add_argument("--ipc", default=None, metavar="ADDRESS", help="ask the daemon at this address")
        sub.add_argument(
            "--model-repository",
            type=Path,
            action=RepeatedFlag,
            default=None,
            metavar="DIR",
            help="load this repository in this process (repeat it for several)",
        )
        sub.add_argument("--local", action="store_true", help="load the bundled repository in this process")
        if name == "infer":
            sub.add_argument("model")
            sub.add_argument("--model-version", type=int, default=None)
            sub.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy")
            sub.add_argument(
                "--image", type=Path, default=None, help="an image file for a one-input image model"
            )
            sub.add_argument(
                "--channel-order",
                choices=CHANNEL_ORDERS,
                default="bgr",
                help="the order of a colour --image's channels: bgr (default, as OpenCV reads images and "
                "OpenCV-based pipelines expect them) or rgb",
            )
            sub.add_argument("--output", action="append", default=None, metavar="NAME")
            sub.add_argument("--top", type=int, default=3, help="classes to print for classification outputs")


@contextlib.contextmanager
def _target(args: argparse.Namespace) -> Iterator[tuple[Any, bool]]:
    """A client of the running daemon, or a local Server (--model-repository, --local); and which one."""
    if args.ipc and (args.model_repository or args.local):
        raise UsageError("--ipc asks a daemon; --model-repository and --local load models here: pick one")
    if not (args.model_repository or args.local):
        from edge_server.client import Client
        from edge_server.ipc.addresses import find_daemon

        with Client(find_daemon(args.ipc), timeout=60) as client:
            yield client, True
        return
    from edge_server.server import Server

    logging.getLogger().setLevel(logging.WARNING)  # a local load should not drown the answer in logs
    # Models print() from their own threads: while they live here their output goes to stderr, never
    # into this command's answer, which is printed after they are closed.
    with contextlib.redirect_stdout(sys.stderr), Server(args.model_repository) as server:
        yield server, False


def run_models(args: argparse.Namespace) -> int:
    with _target(args) as (target, remote):
        # the repository index, as every frontend gives it: a model never loaded has a name alone
        index = target.models() if remote else [index_row(s) for s in target.repository_index()]
        rows = [
            (
                m["name"],
                m.get("version"),
                m.get("state", "-"),
                m.get("reason", "not loaded" if "state" not in m else ""),
            )
            for m in index
        ]
    print(f"{'MODEL':<24} {'VERSION':<8} {'STATE':<12} REASON")
    for name, version, state, reason in rows:
        print(f"{name:<24} {'-' if version is None else version!s:<8} {state:<12} {reason}")
    return 0


def run_infer(args: argparse.Namespace) -> int:
    with _target(args) as (target, remote):
        metadata = target.model_metadata(args.model)
        if remote:  # label files are read from the daemon's repository, on this same box
            config, repositories = target.model_config(args.model), target.status()["repositories"]
        else:
            config, repositories = target.model_config(args.model).to_triton_dict(), target.repositories.roots
        inputs, notes = _read_inputs(args, metadata, config)
        outputs = target.infer(args.model, inputs, version=args.model_version, outputs=args.output)
        labels = _labels(config, _model_directory(repositories, args.model))
    for note in notes:  # what was sent, where it is not plain (an image's channel order)
        print(note)
    for name, array in outputs.items():
        print(f"{name}: {array.dtype} {list(array.shape)}")
        print(np.array2string(array, threshold=64, precision=5))
        if name in labels and array.ndim >= 1 and array.dtype.kind == "f":
            scores = array.reshape(-1, array.shape[-1])[0]
            top = np.argsort(scores)[::-1][: args.top]
            for rank, index in enumerate(top, 1):
                print(f"  #{rank}: {labels[name][index]} ({scores[index]:.4f})")
    return 0


def _read_inputs(
    args: argparse.Namespace, metadata: dict[str, Any], config: dict[str, Any]
) -> tuple[dict[str, np.ndarray], list[str]]:
    """The request's tensors from --input and --image, and lines saying how an image was converted."""
    inputs: dict[str, np.ndarray] = {}
    notes: list[str] = []
    for item in args.input:
        name, sep, path = item.partition("=")
        if not sep:
            raise UsageError(f"--input expects NAME=FILE.npy, got {item!r}")
        try:
            array = np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError) as exc:  # missing, unreadable, not .npy, pickled objects
            raise InvalidArgument(f"--input {name}: cannot read {path} as a .npy array: {exc}") from None
        spec = next((t for t in metadata["inputs"] if t["name"] == name), None)
        if spec is not None and array.ndim == len(spec["shape"]) - 1 and spec["shape"][:1] == [-1]:
            array = array[None]  # a single sample for a batching model: add the batch axis
        inputs[name] = array
    if args.image is not None:
        if len(metadata["inputs"]) != 1:
            raise EdgeServerError(
                f"--image needs a model with one input; {args.model!r} has {metadata['inputs']}"
            )
        spec = metadata["inputs"][0]
        layout = next(
            (t.get("format", "") for t in config.get("input", []) if t.get("name") == spec["name"]), ""
        )
        array, described = image_tensor(
            args.image,
            spec,
            channel_order=args.channel_order,
            batched=int(config.get("max_batch_size", 0)) > 0,
            layout=str(layout),
        )
        inputs[spec["name"]] = array
        notes.append(f"image {args.image} -> input {spec['name']!r}: {described}")
    if not inputs:
        raise UsageError("give --input NAME=FILE.npy (repeatable) or --image FILE")
    return inputs, notes


def _model_directory(repositories: Sequence[str | Path], model: str) -> Path | None:
    """The model's directory on this box: in the one repository that holds it (names are unique)."""
    return next((Path(root) / model for root in repositories if (Path(root) / model).is_dir()), None)


def _labels(config: dict[str, Any], model_dir: Path | None) -> dict[str, list[str]]:
    """Class names of outputs with a ``label_filename``, read from the model's directory on this box."""
    labels: dict[str, list[str]] = {}
    if model_dir is None:
        return labels
    for spec in config.get("output", []):
        path = model_dir / spec.get("label_filename", "")
        if spec.get("label_filename") and path.is_file():
            with contextlib.suppress(OSError):  # not readable by this user: print scores without names
                labels[spec["name"]] = path.read_text().split("\n")
    return labels
