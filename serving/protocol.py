"""The Open Inference Protocol (KServe v2 REST) request and response bodies.

Inputs come as JSON tensors (`"data"`, flat or nested in row-major order) or, with
the binary tensor extension (what `tritonclient` sends by default), as raw bytes
after a JSON header whose length is in the `Inference-Header-Content-Length` header.
Every malformed request raises `ProtocolError` with a message for the client.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

HEADER_LENGTH = "inference-header-content-length"
DTYPES = {"FP32": np.float32, "INT64": np.int64, "UINT64": np.uint64}


class ProtocolError(Exception):
    """A request that does not follow the protocol or the model's inputs (HTTP `status`)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def parse_body(body: bytes, headers: Mapping[str, str]) -> tuple[dict[str, Any], bytes]:
    """(JSON request, binary tail) of an infer request body."""
    header_length = headers.get(HEADER_LENGTH)
    binary = b""
    if header_length is not None:
        try:
            length = int(header_length)
        except ValueError:
            raise ProtocolError(f"{HEADER_LENGTH} {header_length!r} is not an integer") from None
        if not 0 <= length <= len(body):
            raise ProtocolError(f"{HEADER_LENGTH} {length} is outside the body ({len(body)} bytes)")
        body, binary = body[:length], body[length:]
    try:
        request = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ProtocolError(f"malformed JSON: {error}") from None
    if not isinstance(request, dict):
        raise ProtocolError("the request body must be a JSON object")
    return request, binary


def decode_inputs(request: dict[str, Any], binary: bytes) -> dict[str, tuple[str, list[int], Any]]:
    """{name: (datatype, shape, values)}: values a numpy array, or a list of bytes for BYTES."""
    inputs = request.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise ProtocolError("'inputs' must be a non-empty list of tensors")
    decoded, offset = {}, 0
    for tensor in inputs:
        if not isinstance(tensor, dict):
            raise ProtocolError("every input must be an object with name, shape, datatype")
        name, datatype, shape = tensor.get("name"), tensor.get("datatype"), tensor.get("shape")
        if not isinstance(name, str):
            raise ProtocolError("an input lacks its 'name'")
        if name in decoded:
            raise ProtocolError(f"input {name!r} is given twice")
        if not (
            isinstance(shape, list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise ProtocolError(f"input {name!r}: 'shape' must be a list of non-negative integers")
        if datatype != "BYTES" and datatype not in DTYPES:
            raise ProtocolError(
                f"input {name!r}: datatype {datatype!r} is not one of BYTES, FP32, INT64, UINT64"
            )
        count = math.prod(shape)
        size = (tensor.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or size < 0 or offset + size > len(binary):
                raise ProtocolError(f"input {name!r}: binary_data_size {size!r} exceeds the body")
            chunk, offset = binary[offset : offset + size], offset + size
            values = _binary_values(name, datatype, chunk, count)
        else:
            values = _json_values(name, datatype, tensor.get("data"), count)
        decoded[name] = (datatype, shape, values)
    return decoded


def _json_values(name: str, datatype: str, data: Any, count: int) -> Any:
    if not isinstance(data, list):
        raise ProtocolError(f"input {name!r}: 'data' must be a list")
    flat = _flatten(data)
    if len(flat) != count:
        raise ProtocolError(f"input {name!r}: {len(flat)} values for a shape of {count} elements")
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in flat):
            raise ProtocolError(f"input {name!r}: BYTES data must be strings")
        return [v.encode() for v in flat]
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in flat):
        raise ProtocolError(f"input {name!r}: {datatype} data must be numbers")
    if datatype != "FP32" and not all(isinstance(v, int) for v in flat):
        raise ProtocolError(f"input {name!r}: {datatype} data must be integers")
    try:
        return np.array(flat, DTYPES[datatype])
    except OverflowError:
        raise ProtocolError(f"input {name!r}: a value is out of the {datatype} range") from None


def _flatten(data: list) -> list:
    if not any(isinstance(v, list) for v in data):
        return data
    out = []
    for value in data:
        out.extend(_flatten(value) if isinstance(value, list) else [value])
    return out


def _binary_values(name: str, datatype: str, chunk: bytes, count: int) -> Any:
    if datatype != "BYTES":
        dtype = np.dtype(DTYPES[datatype]).newbyteorder("<")
        if len(chunk) != count * dtype.itemsize:
            raise ProtocolError(f"input {name!r}: {len(chunk)} bytes for {count} {datatype} values")
        return np.frombuffer(chunk, dtype).astype(DTYPES[datatype])
    values, position = [], 0
    while position < len(chunk):
        if position + 4 > len(chunk):
            raise ProtocolError(f"input {name!r}: truncated BYTES element")
        (length,) = struct.unpack_from("<I", chunk, position)
        position += 4
        if position + length > len(chunk):
            raise ProtocolError(f"input {name!r}: truncated BYTES element")
        values.append(chunk[position : position + length])
        position += length
    if len(values) != count:
        raise ProtocolError(f"input {name!r}: {len(values)} values for a shape of {count} elements")
    return values


def requested_outputs(request: dict[str, Any], known: tuple[str, ...]) -> bool:
    """Checks the requested outputs; returns whether they are wanted as binary data."""
    outputs = request.get("outputs")
    binary = bool((request.get("parameters") or {}).get("binary_data_output", False))
    if outputs is None:
        return binary
    if not isinstance(outputs, list):
        raise ProtocolError("'outputs' must be a list")
    for output in outputs:
        name = output.get("name") if isinstance(output, dict) else None
        if name not in known:
            raise ProtocolError(f"unknown output {name!r}; this model has {', '.join(known)}")
        binary = bool((output.get("parameters") or {}).get("binary_data", binary))
    return binary


def encode_response(
    response: dict[str, Any], name: str, values: np.ndarray, *, binary: bool
) -> tuple[bytes, dict[str, str]]:
    """(body, extra headers) of a response with one FP32 output tensor."""
    tensor: dict[str, Any] = {"name": name, "datatype": "FP32", "shape": list(values.shape)}
    if not binary:
        tensor["data"] = values.astype(np.float32).tolist()
        return json.dumps({**response, "outputs": [tensor]}).encode(), {}
    data = values.astype("<f4").tobytes()
    tensor["parameters"] = {"binary_data_size": len(data)}
    header = json.dumps({**response, "outputs": [tensor]}).encode()
    return header + data, {"Inference-Header-Content-Length": str(len(header))}
