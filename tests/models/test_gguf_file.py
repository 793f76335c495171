"""GGUFFile's metadata against gguf-py's own GGUFReader fields: every key of the real files and of a
synthetic file with every value type in both byte orders; bad and truncated files."""

from __future__ import annotations

import shutil
import struct

import gguf
import numpy as np
import pytest
from gguf import GGUFEndian, GGUFReader, GGUFValueType

from jaxpaged.models.gguf_file import GGUFFile
from jaxpaged.models.gguf_loader import metadata_value, open_gguf
from jaxpaged.models.loader import resolve_model_path
from jaxpaged.models.weights import WeightLoadError

V = GGUFValueType


def assert_same_as_gguf_py(path):
    ours, theirs = GGUFFile(str(path)), GGUFReader(str(path))
    want = {key: field.contents() for key, field in theirs.fields.items()}
    assert list(ours.metadata) == list(want)
    for key, value in want.items():
        got = ours.metadata[key]
        assert got == value and type(got) is type(value), key
        if isinstance(value, list):
            assert [type(v) for v in got] == [type(v) for v in value], key
        assert metadata_value(ours, key) == value
    assert ours.data_offset == theirs.data_offset and len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.shape.tolist(), a.data_offset) == (b.name, b.tensor_type, b.shape.tolist(),
                                                                            b.data_offset)
        np.testing.assert_array_equal(a.data, b.data)
    return ours


def write_every_type(path, endianess):
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    scalars = {V.UINT8: 200, V.INT8: -100, V.UINT16: 60000, V.INT16: -30000, V.UINT32: 4_000_000_000,
               V.INT32: -2_000_000_000, V.FLOAT32: 0.1, V.UINT64: 2**63 + 5, V.INT64: -(2**62), V.FLOAT64: 0.1,
               V.BOOL: True}
    for kind, value in scalars.items():
        writer.add_key_value(f"test.scalar.{kind.name}", value, kind)
        writer.add_key_value(f"test.array.{kind.name}", [value, value, value], V.ARRAY, sub_type=kind)
    writer.add_key_value("test.string", "Grüße, 世界 😀", V.STRING)
    writer.add_key_value("test.string.empty", "", V.STRING)
    writer.add_key_value("test.array.strings", ["a", "", " b c", "Ġthe", "<|im_end|>", "😀"], V.ARRAY)
    writer.add_key_value("test.array.nested", [[1, 2], [3], [4, 5, 6]], V.ARRAY)
    writer.add_custom_alignment(64)  # general.alignment, not the default 32: the tensor offsets depend on it
    writer.add_tensor("a", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.add_tensor("b", np.arange(5, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("endianess", [GGUFEndian.LITTLE, GGUFEndian.BIG])
def test_every_value_type_reads_as_gguf_py_does(tmp_path, endianess):
    ours = assert_same_as_gguf_py(write_every_type(tmp_path / "every.gguf", endianess))
    assert ours.metadata["test.array.nested"] == [1, 2, 3, 4, 5, 6]  # flattened, as gguf-py's field data
    assert ours.metadata["general.alignment"] == 64 and ours.data_offset % 64 == 0
    assert ours.byte_order == ("I" if endianess == GGUFEndian.LITTLE else "S")  # this host is little-endian


def test_smollm2_metadata_is_gguf_py_s(smollm2_path):
    ours = assert_same_as_gguf_py(smollm2_path)
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152


@pytest.mark.slow  # gguf-py's own reader takes ~8 s over Gemma's 262k-token vocabulary
def test_gemma3_metadata_is_gguf_py_s():
    ours = assert_same_as_gguf_py(resolve_model_path("gemma3-270m"))
    assert len(ours.metadata["tokenizer.ggml.scores"]) == 262144


def test_invalid_utf8_in_a_string_array_is_replaced(tmp_path):
    path = tmp_path / "bad-utf8.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_key_value("test.tokens", [b"ok", b"\xff\xfe", b"caf\xc3"], V.ARRAY, sub_type=V.STRING)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert GGUFFile(str(path)).metadata["test.tokens"] == ["ok", "\ufffd\ufffd", "caf\ufffd"]


@pytest.mark.parametrize("where", ["magic", "first key", "tokens", "merges", "tensor infos", "tensor data"])
def test_a_truncated_file_is_a_clear_error(tmp_path, smollm2_path, where):
    full = GGUFFile(str(smollm2_path))
    header = bytes(full.data[:full.data_offset])
    cut = {"magic": 3, "first key": 30, "tokens": header.find(b"tokenizer.ggml.tokens") + 5000,
           "merges": header.find(b"tokenizer.ggml.merges") + 5000, "tensor infos": full.data_offset - 100,
           "tensor data": len(full.data) - 1000}[where]
    path = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as src, open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
        dst.truncate(cut)
    with pytest.raises(WeightLoadError, match="not a readable GGUF file"):
        open_gguf(path)


def test_an_impossible_string_count_fails_at_once(tmp_path):
    """A string array claiming more strings than the file has bytes for is refused before any is read."""
    path = tmp_path / "huge-count.gguf"
    key = b"tokenizer.ggml.tokens"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                     + struct.pack("<IIQ", V.ARRAY, V.STRING, 2**40) + b"\x00" * 64)
    with pytest.raises(WeightLoadError, match="runs past the end of the file"):
        open_gguf(path)


def test_a_duplicate_key_is_refused(tmp_path):
    path = tmp_path / "duplicate.gguf"
    key = struct.pack("<Q", 3) + b"a.b"
    array = struct.pack("<IIQ", V.ARRAY, V.INT32, 2) + struct.pack("<ii", 1, 2)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + (key + array) * 2 + b"\x00" * 64)
    with pytest.raises(WeightLoadError, match="duplicate GGUF key 'a.b'"):
        open_gguf(path)
