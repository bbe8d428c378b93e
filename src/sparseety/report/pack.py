"""Embed arrays and data in a page: base64 typed arrays and JSON that is safe inside ``<script>``."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np

#: JS typed-array names for the dtypes the page decodes (float16 is decoded by hand).
DTYPES = {"uint8": "u8", "uint16": "u16", "uint32": "u32", "int32": "i32", "float16": "f16", "float32": "f32"}


def pack(array: np.ndarray) -> dict[str, Any]:
    """``{"dtype", "shape", "b64"}``: the array's little-endian bytes, row-major, base64-encoded."""
    array = np.ascontiguousarray(array)
    name = DTYPES.get(array.dtype.name)
    if name is None:
        raise TypeError(f"cannot pack dtype {array.dtype}; use one of {sorted(DTYPES)}")
    data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
    return {"dtype": name, "shape": list(array.shape), "b64": base64.b64encode(data).decode("ascii")}


def unpack(packed: dict[str, Any]) -> np.ndarray:
    """Inverse of :func:`pack`."""
    names = {v: k for k, v in DTYPES.items()}
    dtype = np.dtype(names[packed["dtype"]]).newbyteorder("<")
    return np.frombuffer(base64.b64decode(packed["b64"]), dtype=dtype).reshape(packed["shape"])


def smallest_uint(max_value: int) -> np.dtype:
    """The narrowest unsigned dtype that holds ``0 .. max_value``."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if max_value <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise ValueError(f"{max_value} does not fit in 32 bits")


def script_json(data: Any) -> str:
    """JSON for a ``<script type="application/json">`` body: no ``<``, ``>``, ``&`` can close the tag."""
    text = json.dumps(clean(data), separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026") \
        .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def clean(value: Any) -> Any:
    """Plain JSON values: NumPy scalars and arrays to Python, NaN and infinities to None."""
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if isinstance(value, np.ndarray):
        return clean(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not np.isfinite(value):
        return None
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
