"""The background save's data files, written around the page cache (``fzero.checkpoint.direct.DirectFile``): the
file holds exactly the bytes written, at every flush and at close, whatever the sizes of the writes; ``O_DIRECT``
where the file system takes it, the page cache where it refuses it (at open or at the first write); any other
write error raised, and a background save's failure naming its checkpoint."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import fzero
import fzero.checkpoint.background as background
import fzero.checkpoint.direct as direct
from ckpt_worker import fresh
from fzero.checkpoint import CheckpointError, save_checkpoint
from fzero.checkpoint.direct import ALIGN, BUFFER_BYTES, DirectFile

O_DIRECT = getattr(os, "O_DIRECT", 0)


def _has_direct(fd: int) -> bool:
    return bool(O_DIRECT) and bool(fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT)


def _takes_direct(d: Path) -> bool:
    """Whether the file system under ``d`` opens files with ``O_DIRECT`` (tmpfs does not)."""
    if not O_DIRECT:
        return False
    try:
        fd = os.open(d / "probe", os.O_WRONLY | os.O_CREAT | O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.remove(d / "probe")
    return True


# sizes about the alignment and the buffer's boundaries, where the staging moves bytes
_SIZES = st.sampled_from([0, 1, 7, ALIGN - 1, ALIGN, ALIGN + 1, 3 * ALIGN + 5, BUFFER_BYTES - 1, BUFFER_BYTES,
                          BUFFER_BYTES + ALIGN + 3])
_OPS = st.lists(st.tuples(_SIZES, st.booleans()), max_size=6)  # (bytes written, flush after it)


@given(ops=_OPS, seed=st.integers(0, 255))
def test_file_holds_exactly_the_bytes_written_at_every_flush_and_at_close(tmp_path_factory, ops, seed):
    path = tmp_path_factory.mktemp("direct") / "f.bin"
    written = bytearray()
    with DirectFile(path) as f:
        for i, (n, flush) in enumerate(ops):
            data = bytes((seed + i + j) % 251 for j in range(min(n, 512))) * (n // 512 + 1)
            data = data[:n]
            assert f.write(memoryview(data)) == n
            written += data
            assert f.tell() == len(written)
            if flush:
                f.flush()
                assert path.read_bytes() == written
    assert f.closed
    assert path.read_bytes() == written


def test_fileno_flushes_first_so_an_fsync_covers_every_byte(tmp_path):
    path = tmp_path / "f.bin"
    f = DirectFile(path)
    f.write(b"x" * (ALIGN + 17))
    os.fsync(f.fileno())  # DCP's writer: fsync(stream.fileno()), then close
    assert path.read_bytes() == b"x" * (ALIGN + 17)
    f.write(b"y" * 3)  # goes on from the partial block that stays staged
    f.close()
    assert path.read_bytes() == b"x" * (ALIGN + 17) + b"yyy"


def test_opened_with_o_direct_where_the_file_system_takes_it(tmp_path):
    if not _takes_direct(tmp_path):
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT")
    with DirectFile(tmp_path / "f.bin") as f:
        assert _has_direct(f.fd)
        f.write(b"a" * (BUFFER_BYTES + 5))
        assert _has_direct(f.fd)  # whole blocks from the aligned buffer: the flag kept
    assert (tmp_path / "f.bin").read_bytes() == b"a" * (BUFFER_BYTES + 5)


def test_a_file_system_refusing_o_direct_at_open_gets_the_page_cache(tmp_path, monkeypatch):
    real_open = os.open

    def tmpfs_open(path, flags, *args):  # as tmpfs answers
        if O_DIRECT and flags & O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct.os, "open", tmpfs_open)
    with DirectFile(tmp_path / "f.bin") as f:
        assert not _has_direct(f.fd)
        f.write(b"b" * (ALIGN + 1))
    assert (tmp_path / "f.bin").read_bytes() == b"b" * (ALIGN + 1)


def test_a_file_system_refusing_the_direct_write_gets_the_page_cache(tmp_path, monkeypatch):
    if not _takes_direct(tmp_path):
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT")
    real_pwrite, refused = os.pwrite, []

    def refusing(fd, data, offset):  # a file system that opens with O_DIRECT and refuses its writes
        if _has_direct(fd):
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(direct.os, "pwrite", refusing)
    with DirectFile(tmp_path / "f.bin") as f:
        f.write(b"c" * (2 * ALIGN + 9))
    assert refused == [0]  # refused once, then through the page cache
    assert (tmp_path / "f.bin").read_bytes() == b"c" * (2 * ALIGN + 9)


def test_an_invalid_write_without_o_direct_to_drop_is_raised(tmp_path, monkeypatch):
    def invalid(fd, data, offset):
        raise OSError(errno.EINVAL, "Invalid argument")

    real_open = os.open
    monkeypatch.setattr(direct.os, "open", lambda path, flags, *a: real_open(path, flags & ~O_DIRECT, *a))
    monkeypatch.setattr(direct.os, "pwrite", invalid)
    f = DirectFile(tmp_path / "f.bin")
    f.write(b"d" * 10)
    with pytest.raises(OSError) as info:
        f.close()
    assert info.value.errno == errno.EINVAL and f.closed


def test_a_full_disk_during_a_background_save_is_raised_naming_the_checkpoint(tmp_path, monkeypatch):
    """ENOSPC from a data file's write: ``wait()`` raises a ``CheckpointError`` naming the checkpoint; ``LATEST``
    still names the previous one."""
    background.settle()
    comm = fzero.SimulatedWorld(2)
    state = fresh(comm)
    save_checkpoint(state, tmp_path, comm, name="first")

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct.os, "pwrite", full)
    handle = save_checkpoint(state, tmp_path, comm, name="second", blocking=False)
    with pytest.raises(CheckpointError, match="second") as info:
        handle.wait(timeout=60)
    assert "No space left on device" in str(info.value) and len(str(info.value)) < 1000
    assert ".distcp" in str(info.value)  # the data file
    assert (tmp_path / "LATEST").read_text().strip() == "first"
    assert not (tmp_path / "second").exists()
