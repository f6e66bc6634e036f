"""A file written around the page cache (``O_DIRECT``), for the background save's writer: the bytes go from an
aligned buffer of the writer's own to the disk, so the write neither fills the page cache (evicting what the
training reads) nor leaves dirty pages for the kernel's writeback threads, which run at normal priority beside the
training's cores whatever the writer's own priority. Where the file system refuses ``O_DIRECT`` (tmpfs, some network
and FUSE file systems) or the platform has none, the same class writes through the page cache: the file's bytes are
the same either way.

Imports: none of fzero.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from pathlib import Path
from typing import Any

__all__ = ["DirectFile"]

ALIGN = 4096  # offsets, lengths and buffer addresses of O_DIRECT writes: a multiple of every usual logical block
BUFFER_BYTES = 8 << 20  # one pwrite per 8 MiB: large enough for the disk, small enough to stay out of the way


class DirectFile:
    """A new file open for writing, its bytes staged in a page-aligned buffer and written a whole number of
    :data:`ALIGN` blocks at a time with ``pwrite``. :meth:`flush` writes what is staged, its last partial block padded
    with zeros and the file then truncated to the bytes written: the file on disk always has exactly the bytes
    written so far, and the partial block stays staged so that the next write goes on from it.

    The subset of a binary file's interface DCP's writer and :class:`~.checksums.ChecksumWriter` use: ``write``,
    ``tell``, ``flush``, ``fileno`` (flushed first: DCP fsyncs the descriptor before closing), ``close``,
    ``closed``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        direct = getattr(os, "O_DIRECT", 0)
        try:
            self.fd = os.open(path, flags | direct, 0o666)
        except OSError as e:
            if not direct or e.errno != errno.EINVAL:
                raise
            self.fd = os.open(path, flags, 0o666)  # a file system without O_DIRECT
        self.path = Path(path)
        self.buffer = mmap.mmap(-1, BUFFER_BYTES)  # anonymous: page-aligned
        self.base = 0  # the file offset of buffer[0]: a multiple of ALIGN
        self.staged = 0  # bytes in the buffer
        self.closed = False

    def write(self, data: Any) -> int:
        if self.closed:
            raise ValueError(f"write to closed file {self.path}")
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            n = min(len(view) - done, BUFFER_BYTES - self.staged)
            self.buffer[self.staged : self.staged + n] = view[done : done + n]
            self.staged += n
            done += n
            if self.staged == BUFFER_BYTES:
                self._write_staged()
        return done

    def tell(self) -> int:
        return self.base + self.staged

    def flush(self) -> None:
        if self.closed:
            return
        end = self.base + self.staged
        self._write_staged()  # the whole blocks; a partial one moved to the buffer's start
        if self.staged:  # written padded to a whole block, the file cut back to its real end
            self.buffer[self.staged : ALIGN] = bytes(ALIGN - self.staged)
            self._pwrite(memoryview(self.buffer)[:ALIGN], self.base)
            os.ftruncate(self.fd, end)

    def fileno(self) -> int:
        self.flush()
        return self.fd

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.flush()
        finally:
            self.closed = True
            os.close(self.fd)
            # not mmap.close(): a failed write's traceback may still hold a view of the buffer; the mapping goes with
            # its last reference
            del self.buffer

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write_staged(self) -> None:
        """Write the staged whole blocks at :attr:`base`; move the partial block after them to the buffer's start."""
        whole = self.staged - self.staged % ALIGN
        if whole:
            self._pwrite(memoryview(self.buffer)[:whole], self.base)
            rest = self.staged - whole
            self.buffer.move(0, whole, rest)
            self.base += whole
            self.staged = rest

    def _pwrite(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            try:
                done += os.pwrite(self.fd, view[done:], offset + done)
            except OSError as e:
                if e.errno != errno.EINVAL or not self._drop_direct():
                    raise OSError(e.errno, e.strerror, str(self.path)) from e  # the message names the file
            # a short write ends on a block boundary on Linux; whatever it is, the rest follows it

    def _drop_direct(self) -> bool:
        """The file system took ``O_DIRECT`` at open but refuses the write: go on through the page cache. False
        if the descriptor had no ``O_DIRECT`` to drop (the ``EINVAL`` is the write's own)."""
        direct = getattr(os, "O_DIRECT", 0)
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        if not direct or not flags & direct:
            return False
        fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~direct)
        return True
