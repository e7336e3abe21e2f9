"""Writing build outputs: only when the bytes change, atomically, under a lock that gives up.

The conventions are those of FlashInfer's JIT cache, for the same reasons:

- **write-if-different**: a target is compared with the new content as bytes (never decoded: a
  file cut inside a multi-byte character must read as different, not crash), and is left alone
  when equal, so an unchanged build keeps its mtime and nothing downstream rebuilds.
- **atomic**: the new bytes go to a temporary file in the target's folder, are flushed to disk,
  and replace the target by a rename; a reader sees the old file or the new one, never half.
- **a file lock around the write**, ``.<target>.lock`` beside the target (not under a
  predictable name in /tmp): concurrent builds of one target take turns. It is an ``flock``,
  which the kernel releases when the holder exits, however it exits; the holder deletes the
  file when it is done. A waiter gives up after ``$BAMGEN_LOCK_TIMEOUT`` seconds (default 60)
  with a message that names the holder and how to clear it.

Temporary files are named ``.<target>.<pid>.<random>.tmp`` and deleted when a write fails. A
build killed between writing and renaming (SIGKILL, power loss) leaves one behind; the next
write of that target deletes it: it holds the lock, so no other writer can be mid-way.
"""
from __future__ import annotations

import errno
import fcntl
import glob
import os
import secrets
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from ..resources import GENERATED_BY

LOCK_TIMEOUT_ENV = "BAMGEN_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT = 60.0   # seconds; a write holds the lock for milliseconds


class BuildLockTimeout(TimeoutError):
    """Another process held a target's build lock for longer than the lock timeout."""


def write_if_different(target: str | os.PathLike, content: bytes | str) -> bool:
    """Write ``content`` to ``target`` unless it already holds exactly those bytes.

    Returns True when the file was written. Creates the folder; raises OSError on a failed
    write (the old file is then untouched) and :class:`BuildLockTimeout` on a held lock.
    """
    target = Path(target)
    data = content.encode("utf-8") if isinstance(content, str) else bytes(content)
    if holds(target, data) and not _temporaries(target) and not lock_path(target).exists():
        return False   # no lock needed to leave a file alone (a read-only folder stays fine)
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target):
        remove_stale_temporaries(target)
        if holds(target, data):
            return False
        _replace(target, data)
        return True


def holds(target: str | os.PathLike, content: bytes | str) -> bool:
    """Whether ``target`` is a file whose bytes are exactly ``content``."""
    data = content.encode("utf-8") if isinstance(content, str) else content
    try:
        if os.path.getsize(target) != len(data):
            return False
        with open(target, "rb") as fh:
            return fh.read(len(data) + 1) == data
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return False


def generated_by_bamgen(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file that begins with the header line bamgen writes at the top of
    every module it generates (bamgen/resources.py: GENERATED_BY); a few bytes are read."""
    mark = f"# {GENERATED_BY} ".encode()
    try:
        with open(path, "rb") as fh:
            return fh.read(len(mark)) == mark
    except OSError:
        return False


def _temporaries(target: Path) -> list[Path]:
    return list(target.parent.glob(f".{glob.escape(target.name)}.*.tmp"))


def remove_stale_temporaries(target: Path) -> None:
    """Delete the temporary files a killed write of ``target`` left (call with the lock held)."""
    for leftover in _temporaries(target):
        try:
            leftover.unlink()
        except FileNotFoundError:
            pass


def _replace(target: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``target``, flush it to disk, rename it over."""
    tmp = target.parent / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        # 0o666 less the umask, as a plain open() would give (mkstemp's 0o600 would not do for
        # a module in a shared source tree).
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _sync_folder(target.parent)


def _sync_folder(folder: Path) -> None:
    """Make the rename itself durable (best effort: not every file system allows it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def lock_path(target: str | os.PathLike) -> Path:
    """The lock file of ``target``: ``.<name>.lock`` in the same folder."""
    target = Path(target)
    return target.parent / f".{target.name}.lock"


def lock_timeout() -> float:
    """$BAMGEN_LOCK_TIMEOUT in seconds, else 60."""
    text = os.environ.get(LOCK_TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_LOCK_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0:
        raise ValueError(f"{LOCK_TIMEOUT_ENV}={text!r}: give a number of seconds >= 0")
    return value


@contextmanager
def file_lock(target: str | os.PathLike, timeout: float | None = None):
    """Hold the build lock of ``target`` (see the module docstring) for the ``with`` block."""
    path = lock_path(target)
    timeout = lock_timeout() if timeout is None else timeout
    fd = _acquire(path, time.monotonic() + timeout, timeout, Path(target))
    try:
        _record_holder(fd)
        yield path
    finally:
        try:   # delete while still holding it: a waiter that then gets the old file retries
            os.unlink(path)
        except FileNotFoundError:
            pass
        os.close(fd)


def _acquire(path: Path, deadline: float, timeout: float, target: Path) -> int:
    """flock ``path``, polling until ``deadline``; returns the open descriptor."""
    delay = 0.01
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            while not _try_lock(fd):
                if time.monotonic() >= deadline:
                    raise BuildLockTimeout(_timeout_message(path, fd, timeout, target))
                time.sleep(delay)
                delay = min(delay * 2, 0.25)
            if _is_current(fd, path):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)   # the holder deleted the file as we waited on it: lock the new one


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def _is_current(fd: int, path: Path) -> bool:
    """Whether ``fd`` is still the file at ``path`` (not one its last holder deleted)."""
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (on_disk.st_dev, on_disk.st_ino)


def _record_holder(fd: int) -> None:
    """Write who holds the lock into it, for the message a waiter prints."""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
    command = " ".join(sys.argv)[:200] or "python"
    record = f"process {os.getpid()} on {socket.gethostname()} since {since} ({command})\n"
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode("utf-8", "replace"), 0)
    except OSError:
        pass   # the record is for messages only


def _timeout_message(path: Path, fd: int, timeout: float, target: Path) -> str:
    try:
        holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip()
    except OSError:
        holder = ""
    holder = holder or "another process"
    return (f"waited {timeout:g} s for the build lock {path}, held by {holder}: another build is "
            f"writing {target.name}. Wait for it or stop that process; a lock is released when "
            f"its process exits, so if none is running, delete {path}. "
            f"Set {LOCK_TIMEOUT_ENV}=<seconds> to wait longer.")
