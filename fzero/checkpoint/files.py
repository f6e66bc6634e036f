"""How fzero opens the files of a checkpoint, which are untrusted input: only regular files (a FIFO, device or socket
is refused before a byte is read, so nothing hangs), each read within a limit of what it can legitimately hold, and
only inside the checkpoint root unless the caller follows symlinks (:class:`Files`). Every failure is a
:class:`~.errors.CheckpointCorruptError` naming the file.

Imports: errors.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path
from typing import BinaryIO, Optional, Union

from .errors import CheckpointCorruptError

__all__ = ["Files", "METADATA_LIMIT", "LATEST_LIMIT", "NAME_MAX", "checksums_limit"]

PathLike = Union[str, os.PathLike]

# DCP's .metadata grows with the saved entries (a few hundred bytes each): 64 MiB is far above any fzero checkpoint's
# and far below what would hurt a host. A user with a larger one raises it: fzero.checkpoint.files.METADATA_LIMIT = ...
METADATA_LIMIT = 64 << 20
NAME_MAX = 255  # bytes of a checkpoint name (a directory name: the file systems' limit)
LATEST_LIMIT = 4096  # LATEST holds one name and a newline


def checksums_limit(metadata_bytes: int) -> int:
    """What ``checksums.json`` can hold for a ``.metadata`` of ``metadata_bytes``: one record per entry the metadata
    lists, each no longer in JSON than in the pickle (its path, key and chunk), plus a fixed header."""
    return 4 * metadata_bytes + (64 << 10)


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


@dataclasses.dataclass(frozen=True)
class Files:
    """The checkpoint ``root`` (the path the caller gave: a root with ``LATEST`` or one checkpoint directory,
    resolved) and the symlink policy. By default every file read and the directory ``LATEST`` names must resolve
    inside ``root``: a link out of it is refused, naming both paths. ``follow_symlinks=True`` (for checkpoints laid
    out with links) follows them anywhere; the files must still be regular files within their limits."""

    root: Path
    follow_symlinks: bool = False

    @staticmethod
    def of(path: PathLike, follow_symlinks: bool = False) -> "Files":
        return Files(Path(path).resolve(), bool(follow_symlinks))

    def check_inside(self, path: Path) -> None:
        """Raise unless ``path`` resolves inside :attr:`root` (or symlinks are followed)."""
        if self.follow_symlinks:
            return
        real = path.resolve()
        if real != self.root and self.root not in real.parents:
            raise CheckpointCorruptError(f"{path} resolves to {real}, outside the checkpoint root {self.root}: a "
                                         "checkpoint's files are read only inside it (follow_symlinks=True follows "
                                         "links out of it)")

    def open(self, path: Path) -> BinaryIO:
        """``path`` opened for reading, once it is known to be a regular file inside the root. The open does not
        block (a named pipe with no writer would wait for ever); ``FileNotFoundError`` passes through."""
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
                raise CheckpointCorruptError(f"{path} is {_kind(mode)}, not a regular file: a checkpoint's files are "
                                             "read only from regular files")
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise

    def read(self, path: Path, limit: Optional[int] = None) -> bytes:
        """The bytes of regular file ``path``, refused without reading them if there are more than ``limit``
        (default :data:`METADATA_LIMIT`, as set when called)."""
        limit = METADATA_LIMIT if limit is None else limit
        with self.open(path) as f:
            size = os.fstat(f.fileno()).st_size
            data = f.read(limit + 1) if size <= limit else b""
        if size > limit or len(data) > limit:
            raise CheckpointCorruptError(f"{path} holds {max(size, len(data))} bytes, more than the {limit} such a "
                                         "file can hold: it is damaged or not a checkpoint's")
        return data
