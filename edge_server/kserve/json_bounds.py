"""How many Python objects a JSON body may become, checked on its bytes before ``json.loads``.

``json.loads`` turns three bytes of ``[],`` into a 64-byte list: an 8 MiB body of them cost 257 MiB and
seconds of parsing, whatever the tensor's declared shape.  So before parsing, the body's containers
(``[``, ``{``) and values (``,``) are counted on its bytes, outside string values, and refused when
they pass what the declared shapes (``"shape": [...]``) can need: a tensor of shape ``[a, b, c]``
needs ``a*b*c`` values and ``a*b + a + 1`` lists at most, and every tensor a few more objects for its
fields.  Since a client declares whatever shape it likes, lists are also bounded by the body's size
(one per :data:`BYTES_PER_CONTAINER` bytes), so that no body becomes more than a few times its size.
Counting is a few C-speed passes (a regular expression and ``bytes.count``) over windows of
:data:`WINDOW` bytes, in order, and stops at the first window that passes the allowance: an 8 MiB body
of ``[],`` is refused after its first 256 KiB.  Each C call holds the GIL, so one pass over a whole
8 MiB body stalled every other client of the daemon for ~0.1 s; between windows the GIL is released
(:func:`time.sleep` ``(0)``), so no client waits longer than one window's pass.  Bodies under
:data:`SMALL_BODY` are not checked (they cannot cost much).
"""

from __future__ import annotations

import math
import re
import time

from edge_server.errors import MalformedMessage

#: Bodies below this many bytes are parsed unchecked: at most ~2 MiB of Python objects.
SMALL_BODY = 64 << 10
#: Containers and values any body may hold besides what its shapes need (fields, parameters, config).
SLACK = 4096
#: Per tensor: its object, shape, parameters and their fields.
PER_TENSOR = 64
#: Bytes of body per list or object at least, past :data:`SLACK` (a list costs 56-64 bytes of memory).
BYTES_PER_CONTAINER = 16
#: Bytes counted per C call: a window's pass holds the GIL for about a millisecond.
WINDOW = 256 << 10

# Every JSON string, left to right.  Written "unrolled" (a run of plain characters, then escapes each
# followed by a run) rather than with atomic groups, which Python's re has only from 3.11 (JetPack 6 runs
# 3.10): each part can match in one way only, so a failed match gives back at most one run, character by
# character, and no backtracking state is kept per character.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
# From outside a string: whole strings and the text between them, then text up to the next quote.  It
# stops at the opening quote of a string that does not close before the window's end.
_OUTSIDE = re.compile(rb'(?:[^"]*"[^"\\]*(?:\\.[^"\\]*)*")*[^"]*')
# From inside a string (after its opening quote): its text, up to its closing quote or the window's end.
_INSIDE = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*')
# Found in the raw text: a string cannot hold a bare quote, and a client may declare any shape anyway.
_SHAPE = re.compile(rb'"shape"\s*:\s*\[([\d\s,+-]*)\]')
_INT = re.compile(rb"-?\d+")
_CAP = 1 << 40  # a declared product larger than this is no reason to allow more


def check_json_objects(text: bytes | memoryview, *, shapes: bool) -> None:
    """Raise MalformedMessage when ``text`` would build more objects than its shapes need.

    ``shapes``: the body is an inference request, whose ``shape`` fields allow its ``data``; other
    bodies (repository, settings, shared memory) get :data:`SLACK` only.
    """
    if len(text) < SMALL_BODY:
        return
    raw = bytes(text)
    allow_containers = allow_values = SLACK
    if shapes:
        for match in _SHAPE.finditer(raw):
            dims = [min(abs(int(d)), _CAP) for d in _INT.findall(match.group(1))]
            elements = min(math.prod(dims), _CAP)
            rows = min(math.prod(dims[:-1]), elements) if dims else 0
            allow_values += elements + PER_TENSOR
            allow_containers += 2 * rows + PER_TENSOR
    # Whatever the shapes say, lists stay few beside the bytes: a 64-byte list from 3 bytes of "[]," is
    # the worst ratio JSON has (flat data, as tritonclient sends, needs one list per tensor).
    allow_containers = min(allow_containers, SLACK + len(raw) // BYTES_PER_CONTAINER)
    containers, values, whole = _count(raw, allow_containers, allow_values)
    if containers > allow_containers or values > allow_values:
        held = "holds" if whole else "holds at least"
        raise MalformedMessage(
            f"the JSON body {held} {containers} lists and objects and {values + 1} values, more than its "
            f"declared shapes need ({allow_containers} and {allow_values}); it is refused unparsed"
        )


def _count(raw: bytes, allow_containers: int, allow_values: int) -> tuple[int, int, bool]:
    """Containers and separators outside strings, window by window; stops early past an allowance.

    Returns the counts and whether the whole body was counted.
    """
    containers = values = 0
    pos, end = 0, len(raw)
    inside = False  # in a string whose opening quote is before ``pos``
    while pos < end:
        stop = min(pos + WINDOW, end)
        if inside:
            pos = _INSIDE.match(raw, pos, stop).end()  # type: ignore[union-attr] # matches empty
            if pos < stop and raw[pos] == 0x22:  # its closing quote
                pos += 1
                inside = False
            elif pos < stop - 1 or stop == end:  # neither: only a backslash cut off by the window
                break  # a string that never closes: json.loads refuses it
        else:
            cut = _OUTSIDE.match(raw, pos, stop).end()  # type: ignore[union-attr] # matches empty
            bare = _STRING.sub(b'""', raw[pos:cut])
            containers += bare.count(b"[") + bare.count(b"{")
            values += bare.count(b",")
            if containers > allow_containers or values > allow_values:
                return containers, values, cut == end
            if cut < stop:  # a string opens at ``cut`` and goes on past the window
                inside = True
                cut += 1
            pos = cut
        if pos < end:
            time.sleep(0)  # a release point: the GIL goes to whoever waits for it
    return containers, values, True
