"""The bytes a compiled step moves between devices, read from its optimized HLO.

Every collective of the executable is listed with the size S of its result (for the
asynchronous `-start` forms of all-gather and collective-permute, of the output part)
and its group size n, and charged what one device sends in the standard
bandwidth-optimal algorithms:

    all-reduce          2 (n - 1) / n * S     (ring: reduce-scatter, then all-gather)
    all-to-all          (n - 1) / n * S       (keeps its own piece, sends the others)
    all-gather          (n - 1) / n * S
    reduce-scatter      (n - 1) * S
    collective-permute  S

With one device per process (or per host) this is the traffic that crosses processes
(hosts) per step; the backends' own algorithms differ by small constant factors. Each
instruction counts once: a collective inside a loop body is not multiplied by its trip
count, and every branch of a conditional counts (the train steps here have neither).
"""

from __future__ import annotations

import math
import re
from typing import Any

_KINDS = ("all-reduce", "all-to-all", "all-gather", "reduce-scatter", "collective-permute")
_OP = re.compile(
    r"=\s*(?P<shape>.*?)\s(?P<kind>" + "|".join(_KINDS) + r")(?P<start>-start)?\((?P<rest>.*)$"
)
_ARRAY = re.compile(r"\b(?P<dtype>(?:pred|[a-z]+\d[a-z0-9]*))\[(?P<dims>[\d,]*)\]")


def _item_bytes(dtype: str) -> int:
    """Bytes per element of an HLO element type (pred, s8, bf16, f32, c64, f8e4m3fn, ...)."""
    if dtype == "pred":
        return 1
    bits = int(re.match(r"[a-z]+(\d+)", dtype)[1])
    return max(bits // 8, 1)


def _arrays(shape: str) -> list[int]:
    """Bytes of each array in an HLO shape (one, or a tuple's elements in order)."""
    sizes = []
    for match in _ARRAY.finditer(shape):
        dims = [int(d) for d in match["dims"].split(",") if d]
        sizes.append(_item_bytes(match["dtype"]) * math.prod(dims))
    return sizes


def _group_size(rest: str, num_devices: int) -> int:
    """Devices per replica group, from any of the HLO spellings of replica_groups."""
    explicit = re.search(r"replica_groups=\{\{([\d,]*)\}", rest)
    if explicit:
        return len([d for d in explicit[1].split(",") if d])
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=", rest)
    if iota:
        return int(iota[1].split(",")[-1])
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", rest)
    if mesh:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", mesh[1]))
        axes = re.findall(r"'([^']+)'", mesh[2])
        return math.prod(int(sizes[axis]) for axis in axes) if axes else num_devices
    return num_devices  # replica_groups={} or absent: every device


def collective_bytes(hlo_text: str, num_devices: int) -> dict[str, Any]:
    """Bytes one device sends per execution of `compiled.as_text()`, by collective kind.

    Args:
        hlo_text: the optimized HLO of a compiled executable.
        num_devices: devices the executable runs on (the group of `replica_groups={}`).

    Returns:
        {"total": bytes, "<kind>": bytes for each kind present, "ops": [(kind, group size,
        result bytes), ...]}.
    """
    out: dict[str, Any] = {"total": 0, "ops": []}
    for line in hlo_text.splitlines():
        match = _OP.search(line)
        if not match:
            continue
        kind, sizes = match["kind"], _arrays(match["shape"])
        if match["start"] and kind == "all-gather":  # (operands..., outputs...)
            sizes = sizes[len(sizes) // 2 :]
        elif match["start"] and kind == "collective-permute":  # (operand, output, contexts)
            sizes = sizes[1:2]
        size = sum(sizes)
        group = _group_size(match["rest"], num_devices)
        if group <= 1:
            continue
        if kind == "all-reduce":
            sent = 2 * (group - 1) / group * size
        elif kind in ("all-to-all", "all-gather"):
            sent = (group - 1) / group * size
        elif kind == "reduce-scatter":
            sent = (group - 1) * size
        else:
            sent = size
        out[kind] = out.get(kind, 0) + int(sent)
        out["total"] += int(sent)
        out["ops"].append((kind, group, size))
    return out
