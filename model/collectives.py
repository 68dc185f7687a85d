"""The bytes a compiled step moves between devices, read from its optimized HLO.

Every collective of the executable is listed with its operands' size S and its group
size n, and charged what one device sends in the standard bandwidth-optimal algorithms:

    all-reduce          2 (n - 1) / n * S     (ring: reduce-scatter, then all-gather)
    all-to-all          (n - 1) / n * S       (keeps its own piece, sends the others)
    all-gather          (n - 1) / n * S_out
    reduce-scatter      (n - 1) * S_out
    collective-permute  S

With one device per process (or per host) this is the traffic that crosses processes
(hosts) per step; the backends' own algorithms differ by small constant factors.
"""

from __future__ import annotations

import math
import re
from typing import Any

_ITEM_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
}  # fmt: skip
_KINDS = ("all-reduce", "all-to-all", "all-gather", "reduce-scatter", "collective-permute")
_OP = re.compile(
    r"=\s*(?P<shape>.*?)\s(?P<kind>" + "|".join(_KINDS) + r")(?:-start)?\((?P<rest>.*)$"
)
_ARRAY = re.compile(r"\b(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\]")


def _bytes_of(shape: str) -> int:
    total = 0
    for match in _ARRAY.finditer(shape):
        dims = [int(d) for d in match["dims"].split(",") if d]
        total += _ITEM_BYTES.get(match["dtype"], 4) * math.prod(dims)
    return total


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
        operand bytes), ...]}.
    """
    out: dict[str, Any] = {"total": 0, "ops": []}
    for line in hlo_text.splitlines():
        match = _OP.search(line)
        if not match or "-done" in line.split("=")[0]:
            continue
        kind, size = match["kind"], _bytes_of(match["shape"])
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
