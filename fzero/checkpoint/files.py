"""How fzero opens a checkpoint's files, which are untrusted input (:class:`Files`): regular files only (a FIFO,
device or socket is refused before a byte is read: nothing hangs), each read within what it can legitimately hold, and
only inside the checkpoint root unless the caller follows symlinks. Failures: :class:`~.errors.CheckpointCorruptError`
naming the file.

Imports: errors.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path
from typing import BinaryIO

from .errors import CheckpointCorruptError

__all__ = ["Files", "METADATA_LIMIT", "LATEST_LIMIT", "NAME_MAX"]

# .metadata grows with the saved entries (a few hundred bytes each): 64 MiB is far above any fzero checkpoint's and far
# below what would hurt a host; a user with a larger one raises it (read when a file is read)
METADATA_LIMIT = 64 << 20
NAME_MAX = 255  # bytes of a checkpoint name (a directory name: the file systems' limit)
LATEST_LIMIT = 4096  # LATEST holds one name


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


@dataclasses.dataclass(frozen=True)
class Files:
    """The checkpoint ``root`` (resolved: the path the caller gave, a root with ``LATEST`` or one checkpoint) and the
    symlink policy: every file read and the directory ``LATEST`` names must resolve inside ``root``, unless
    ``follow_symlinks`` (checkpoints laid out with links); regular files within their limits either way."""

    root: Path
    follow_symlinks: bool = False

    @staticmethod
    def of(path: str | os.PathLike, follow_symlinks: bool = False) -> Files:
        return Files(Path(path).resolve(), bool(follow_symlinks))

    def check_inside(self, path: Path) -> None:
        if self.follow_symlinks:
            return
        real = path.resolve()
        if real != self.root and self.root not in real.parents:
            raise CheckpointCorruptError(f"{path} resolves to {real}, outside the checkpoint root {self.root}: files "
                                         "are read only inside it (follow_symlinks=True follows links out of it)")

    def open(self, path: Path) -> BinaryIO:
        """``path`` for reading once it is a regular file inside the root; a non-blocking open (a named pipe with no
        writer would wait for ever). ``FileNotFoundError`` passes through."""
        self.check_inside(path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise
        except OSError as e:
            raise CheckpointCorruptError(f"{path} cannot be opened ({e.strerror or e})") from e
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
                raise CheckpointCorruptError(f"{path} is {kind}, not a regular file: a checkpoint's files are read "
                                             "only from regular files")
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise

    def read(self, path: Path, limit: int | None = None) -> bytes:
        """The bytes of ``path``, refused unread if more than ``limit`` (default :data:`METADATA_LIMIT`)."""
        limit = METADATA_LIMIT if limit is None else limit
        with self.open(path) as f:
            size = os.fstat(f.fileno()).st_size
            data = f.read(limit + 1) if size <= limit else b""
        if size > limit or len(data) > limit:
            raise CheckpointCorruptError(f"{path} holds {max(size, len(data))} bytes, more than the {limit} such a "
                                         "file can hold: it is damaged or not a checkpoint's")
        return data
