"""Records to journald's native protocol, received on a real datagram socket standing for the journal's."""

from __future__ import annotations

import logging
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

from edge_server.service.journal import JournalHandler


def parse(datagram: bytes) -> dict[str, str]:
    fields: dict[str, str] = {}
    rest = datagram
    while rest:
        line, sep, after = rest.partition(b"\n")
        if b"=" in line:
            key, _, value = line.partition(b"=")
            fields[key.decode()] = value.decode()
            rest = after
        else:  # binary form
            (size,) = struct.unpack("<Q", after[:8])
            fields[line.decode()] = after[8 : 8 + size].decode()
            rest = after[8 + size + 1 :]
    return fields


def test_fields_priority_and_multiline_messages(tmp_path: Path) -> None:
    journal = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    journal.bind(str(tmp_path / "journal.sock"))
    journal.settimeout(5)
    handler = JournalHandler(str(tmp_path / "journal.sock"))
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    logger = logging.getLogger("edge_server.test_journal")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("m v%d loading", 3, extra={"model": "m", "version": 3})
        fields = parse(journal.recv(65536))
        assert fields["MESSAGE"] == "edge_server.test_journal: m v3 loading"
        assert fields["PRIORITY"] == "4"
        assert (fields["MODEL"], fields["VERSION"]) == ("m", "3")
        assert fields["SYSLOG_IDENTIFIER"] == "edge-server" and fields["CODE_FUNC"].startswith("test_")
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("failed")
        fields = parse(journal.recv(65536))
        assert fields["PRIORITY"] == "3" and "Traceback" in fields["MESSAGE"] and "boom" in fields["MESSAGE"]
        assert "MODEL" not in fields
    finally:
        logger.removeHandler(handler)
        handler.close()
        journal.close()


def test_stderr_is_journal_only_for_the_stream_systemd_named(tmp_path: Path) -> None:
    out = tmp_path / "stderr"
    out.touch()
    info = os.stat(out)
    code = "from edge_server.service.journal import stderr_is_journal; print(stderr_is_journal())"
    for stream, expected in ((f"{info.st_dev}:{info.st_ino}", "True"), ("1:2", "False"), ("junk", "False")):
        with open(out, "w") as err:
            result = subprocess.run(
                [sys.executable, "-c", code],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env={**os.environ, "JOURNAL_STREAM": stream},
            )
        assert result.stdout.strip() == expected
