"""The GGUF container read directly: its metadata (scalars and strings; arrays by their
length) and its tensors memory-mapped, in milliseconds (``read_tensors``). The quantised load
(``models.gguf_quant``) and the metadata directory (``models.gguf.gguf_meta_dir``) use it; the
full conversion reads with the ``gguf`` package.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file, as ``gguf.ReaderTensor`` names its fields."""

    name: str
    shape: tuple[int, ...]  # GGUF order: the innermost (input) dimension first
    tensor_type: object  # gguf.GGMLQuantizationType
    data: np.ndarray  # [rows, bytes per row] uint8 (float32 / float16 values for those types)
    file: mmap.mmap | None = None  # the mapping ``data`` views
    offset: int = 0  # of ``data`` in the file

    def release(self) -> None:
        """Drop the pages of ``data`` from this process's resident memory once it has been
        copied (they stay in the page cache, and ``data`` reads them again if used): loading
        holds one tensor's pages at a time rather than the whole file beside its packed copy."""
        if self.file is None:
            return
        page = mmap.PAGESIZE
        first = -(-self.offset // page) * page
        last = (self.offset + self.data.nbytes) // page * page
        if last > first:
            self.file.madvise(mmap.MADV_DONTNEED, first, last - first)


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}


def _string(buf, pos: int) -> tuple[str, int]:
    """(the GGUF string at ``pos``, the position after it)."""
    (n,) = struct.unpack_from("<Q", buf, pos)
    return bytes(buf[pos + 8:pos + 8 + n]).decode("utf-8", "replace"), pos + 8 + n


def _value(buf, pos: int, kind: int) -> tuple[object, int]:
    """(the GGUF metadata value of type ``kind`` at ``pos``: an array gives its number of
    elements, the position after it). Module functions, not closures over the mapped file: a
    recursive closure is a reference cycle that keeps the file's pages mapped and resident until
    the cyclic collector runs."""
    if kind == 8:
        return _string(buf, pos)
    if kind == 9:
        elem, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if elem in _SCALARS:
            return count, pos + count * struct.calcsize(_SCALARS[elem])
        if elem == 8:  # skipped, not decoded: the tokenizer's ~100 000 strings
            length = struct.Struct("<Q").unpack_from
            for _ in range(count):
                pos += 8 + length(buf, pos)[0]
            return count, pos
        for _ in range(count):
            _, pos = _value(buf, pos, elem)
        return count, pos
    fmt = _SCALARS[kind]
    return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)


def read_tensors(gguf_path: str) -> tuple[dict[str, object], list[GGUFTensor]]:
    """(metadata: scalars and strings, the length of arrays; the tensors memory-mapped) of a
    GGUF file. The gguf
    package's reader builds every metadata array element as a numpy view (the tokenizer's
    ~100 000 strings: ~7 s); this one skips arrays, so it takes milliseconds."""
    import gguf

    with open(gguf_path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        if buf[:4] != b"GGUF":
            raise ValueError("bad magic")
        _, num_tensors, num_kv = struct.unpack_from("<IQQ", buf, 4)
        pos = 24
        meta = {}
        for _ in range(num_kv):
            key, pos = _string(buf, pos)
            (kind,) = struct.unpack_from("<I", buf, pos)
            meta[key], pos = _value(buf, pos + 4, kind)
        infos = []
        for _ in range(num_tensors):
            name, pos = _string(buf, pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, dims, kind, offset))
    except (ValueError, IndexError, KeyError, struct.error, UnicodeError) as e:
        raise ValueError(f"{gguf_path} is not a readable GGUF file ({type(e).__name__}: {e}); "
                         "it may be truncated or corrupt") from None
    alignment = meta.get("general.alignment") or 32
    start = -(-pos // alignment) * alignment
    data = np.frombuffer(buf, dtype=np.uint8)
    tensors = []
    for name, dims, kind, offset in infos:
        qtype = gguf.GGMLQuantizationType(kind)
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        rows = int(np.prod(dims[1:], dtype=np.int64))
        row_bytes = dims[0] // block_size * type_size
        raw = data[start + offset:start + offset + rows * row_bytes].reshape(rows, row_bytes)
        if qtype.name in ("F32", "F16"):
            raw = raw.view(np.float32 if qtype.name == "F32" else np.float16)
            if len(dims) == 1:
                raw = raw.reshape(-1)
        tensors.append(GGUFTensor(name, tuple(dims), qtype, raw, buf, start + offset))
    return meta, tensors
