"""What a user sees on the first run (issue 26 item 5): the converted-GGUF cache keeps one copy
per GGUF content, and the slow first-run phases (GGUF conversion, kernel build) say so on
stderr.

Strategy: the cache key is checked on real files (copies, touched and changed ones) with the
conversion itself replaced by a stub that writes the directory's marker file (the real one takes
~30 s on the bundled model and is covered by the bundled-model tests); the kernel build runs for
real into a temporary cache.
"""

from __future__ import annotations

import hashlib
import os

import pytest

from verispec.models import gguf
from verispec.ops import cpu_build, cpu_kernels


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    conversions = []

    def fake_convert(gguf_path, out_dir):
        conversions.append(gguf_path)
        with open(os.path.join(out_dir, "model.safetensors"), "wb") as f:
            f.write(b"converted")

    monkeypatch.setattr(gguf, "_convert", fake_convert)
    return conversions


def write(path, content: bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return str(path)


def test_one_converted_copy_per_gguf_content(tmp_path, cache, capsys):
    """The same bytes at two paths, and the first file touched (a reinstall), share one
    converted directory; other bytes get another. The first conversion says what it does and
    how to clear the cache."""
    first = write(tmp_path / "a" / "model.gguf", b"GGUF" + b"\x01" * 1000)
    copy = write(tmp_path / "b" / "other-name.gguf", b"GGUF" + b"\x01" * 1000)
    out = gguf.gguf_to_hf_dir(first)
    assert "converting it once" in capsys.readouterr().err
    assert gguf.gguf_to_hf_dir(copy) == out
    os.utime(first, ns=(1, 1))
    assert gguf.gguf_to_hf_dir(first) == out
    assert cache == [first]  # converted once
    assert os.path.basename(out).startswith(
        hashlib.sha256(b"GGUF" + b"\x01" * 1000).hexdigest()[:20])
    other = write(tmp_path / "c" / "model.gguf", b"GGUF" + b"\x02" * 1000)
    assert gguf.gguf_to_hf_dir(other) != out
    assert len(cache) == 2
    entries = os.listdir(os.path.join(gguf.cache_root(), "gguf"))
    assert sorted(e for e in entries if not e.endswith(".json")) == sorted(
        os.path.basename(d) for d in (out, gguf.gguf_to_hf_dir(other)))


def test_a_file_is_hashed_once_until_it_changes(tmp_path, cache, monkeypatch):
    path = write(tmp_path / "model.gguf", b"GGUF" + b"\x03" * 100)
    hashed = []
    digest = hashlib.file_digest
    monkeypatch.setattr(hashlib, "file_digest", lambda f, name: hashed.append(1) or digest(
        f, name))
    first = gguf.content_digest(path)
    assert gguf.content_digest(path) == first and len(hashed) == 1  # from index.json
    write(tmp_path / "model.gguf", b"GGUF" + b"\x04" * 100)
    os.utime(path, ns=(2, 2))
    assert gguf.content_digest(path) != first and len(hashed) == 2


@pytest.mark.skipif(not cpu_build._wanted(), reason="the CPU kernels are not for this machine")
def test_kernel_build_is_announced(tmp_path, monkeypatch, capsys):
    """A build into an empty cache logs where it goes and how long it took."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    cpu_build.load.cache_clear()
    try:
        assert cpu_kernels.available()
    finally:
        cpu_build.load.cache_clear()
    err = capsys.readouterr().err
    assert "building the CPU kernels once" in err and str(tmp_path / "kernels") in err
    assert "built in" in err
    assert any(name.endswith(".so") for name in os.listdir(tmp_path / "kernels"))
