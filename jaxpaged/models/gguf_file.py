"""A GGUF file opened for loading: gguf-py's reader, its key/value header read once into plain Python values.

Why this exists: gguf-py's `GGUFReader` builds a `ReaderField` per key with numpy views of every part of
it, two per string and one per array element, so a vocabulary's 49k tokens and 49k merges (SmolLM2)
cost ~2 s before one tensor is read, 262k tokens and scores (Gemma 3) ~8 s. `GGUFFile` is that reader
with its header walk replaced: each value is decoded straight to Python (arrays of numbers by one
`np.frombuffer`, strings by one pass over their `u64 length + bytes` records), into `metadata`. The
tensors, their types and offsets are still gguf-py's own (`tensors`, built by its `__init__`).

The header (GGUF v2/v3, the file's byte order): n_kv times { key: string, value type: u32, value },
a string = u64 length + UTF-8 bytes, an array = u32 element type + u64 count + the elements.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, ReaderField


class GGUFFile(GGUFReader):
    """gguf-py's reader, with `metadata`: every key -> its value as plain Python (int, float, bool, str,
    or a flat list of those: an array of arrays is flattened, as gguf-py's field data is). String array
    elements are decoded with errors="replace", scalar strings strictly. `fields` holds gguf-py's own
    fields for the header's counts and every scalar or string key, not for array keys (their values
    are in `metadata` only)."""

    metadata: dict[str, Any]

    def _build_fields(self, offs: int, count: int) -> int:
        """Called by GGUFReader.__init__ with the first key's offset and the key count; returns where
        the tensor infos start."""
        buf = memoryview(self.data)
        order = np.dtype(np.uint32).newbyteorder(self.byte_order).byteorder  # "=": this host's, else the other
        self.metadata = {name: field.contents() for name, field in self.fields.items()}  # GGUF.version, counts
        for _ in range(count):
            start = offs
            key, offs = _string(buf, offs, order, "strict")
            if key in self.metadata:  # as gguf-py refuses one
                raise KeyError(f"duplicate GGUF key {key!r} at byte {start}")
            (raw_type,) = struct.unpack_from(order + "I", buf, offs)
            offs += 4
            if raw_type == GGUFValueType.ARRAY:
                self.metadata[key], offs = _array(buf, offs, order)
                continue
            # A scalar or string: gguf-py's own field (a few dozen, cheap; its __init__ reads
            # general.alignment from `fields`).
            size, parts, data, types = self._get_field_parts(offs, raw_type)
            field = ReaderField(start, key, [*self._get_str(start), self._get(offs - 4, np.uint32), *parts],
                                [i + 3 for i in data], types)
            self._push_field(field, skip_sum=True)
            self.metadata[key] = field.contents()
            offs += size
        return offs


def _string(buf: memoryview, offs: int, order: str, errors: str) -> tuple[str, int]:
    (length,) = struct.unpack_from(order + "Q", buf, offs)
    end = offs + 8 + length
    if end > len(buf):
        raise ValueError(f"a string at byte {offs} runs past the end of the file")
    return str(buf[offs + 8:end], "utf-8", errors), end


def _array(buf: memoryview, offs: int, order: str) -> tuple[list, int]:
    """(the array's elements, the offset after it); the type and count are at `offs`."""
    item_type, count = struct.unpack_from(order + "IQ", buf, offs)
    offs += 12
    if item_type == GGUFValueType.STRING:
        if count * 8 > len(buf) - offs:
            raise ValueError(f"a {count}-string array at byte {offs} runs past the end of the file")
        values, length_at = [], struct.Struct(order + "Q").unpack_from
        for _ in range(count):  # inlined: this loop is most of a file's metadata (~100k strings)
            (length,) = length_at(buf, offs)
            values.append(str(buf[offs + 8:offs + 8 + length], "utf-8", "replace"))
            offs += 8 + length
        if offs > len(buf):
            raise ValueError(f"a {count}-string array runs past the end of the file")
        return values, offs
    if item_type == GGUFValueType.ARRAY:
        values = []
        for _ in range(count):
            inner, offs = _array(buf, offs, order)
            values += inner
        return values, offs
    scalar = GGUFReader.gguf_scalar_to_np.get(GGUFValueType(item_type))
    if scalar is None:
        raise ValueError(f"unhandled GGUF array element type {item_type}")
    items = np.frombuffer(buf, np.dtype(scalar).newbyteorder(order), count, offs)  # raises past the end
    return items.tolist(), offs + items.nbytes
