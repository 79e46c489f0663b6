"""An exclusive, process-lifetime lock on a folder (a training run, a quantization target).

An OS file lock (`flock`) rather than a PID file: the kernel releases it when the holder exits in any way, `kill -9`
included, so a lock is never stale and never needs breaking by hand. The lock file records the holder's PID and host
so that the loser's one-line error can name them. Unix only (fcntl), like the rest of the training stack.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Callable

from qerl.errors import BadInput, naming_a_full_disk


class FolderLocked(BadInput, RuntimeError):
    """Another process holds the lock; the message names it (PID and host) in one line."""


# Locks taken with `hand_over=True`, by lock file: a later lock of the same file in this process joins the holder
# instead of failing (a flow takes its run folder before MLflow and Prefect start; the trainer it builds joins).
_handed_over: dict[Path, "FolderLock"] = {}


class FolderLock:
    """`with FolderLock(lock_file, what="run folder runs/x"):` or `lock = FolderLock(...).acquire()` ... `release()`.

    Fails at once (no waiting): two trainers on one folder is a mistake to report, not a queue to form. With
    `hand_over`, later locks of the same file in this process join this one (their release is a no-op): for a
    caller that takes the folder early on behalf of what it starts next. With `on_wait`, a lock held elsewhere is
    waited for instead, after one call `on_wait(holder)` ("PID n on host h"): for work that the holder does for both
    (a shared output the waiter then reuses).
    """

    def __init__(self, lock_file: str | Path, what: str, hand_over: bool = False,
                 on_wait: Callable[[str], None] | None = None):
        self.path = Path(lock_file)
        self.what = what
        self.hand_over = hand_over
        self.on_wait = on_wait
        self._fd: int | None = None
        self._joined = False
        self._made_folder = False

    def acquire(self) -> "FolderLock":
        self._made_folder = not self.path.parent.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        holder = _handed_over.get(self._key())
        if holder is not None and holder.held:
            self._joined = True
            return self
        told = False
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _describe_holder(fd)
                if self.on_wait is None:
                    os.close(fd)
                    raise FolderLocked(f"{self.what} is in use by {holder} (lock file {self.path}); wait for it to "
                                       "finish or stop it, or choose another folder") from None
                if not told:  # said once, however often the file changes hands meanwhile
                    self.on_wait(holder)
                    told = True
                fcntl.flock(fd, fcntl.LOCK_EX)  # blocks until the holder releases (or dies)
            # The previous holder unlinks the file on release: a lock taken on an unlinked file protects nothing,
            # so make sure the path still names the file we locked, else try again on the new one.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self._fd = fd
        try:
            with naming_a_full_disk(self.path):  # the holder's name is the one thing a lock writes
                os.ftruncate(fd, 0)
                os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
                         .encode())
        except BaseException:
            self.release()  # the file, and the folder if we made it: a start that failed leaves no trace
            raise
        if self.hand_over:
            _handed_over[self._key()] = self
        return self

    def _key(self) -> Path:
        return self.path.parent.resolve() / self.path.name

    def release(self) -> None:
        self._joined = False
        if self._fd is None:
            return
        if _handed_over.get(self._key()) is self:
            del _handed_over[self._key()]
        fd, self._fd = self._fd, None
        try:
            self.path.unlink(missing_ok=True)  # while still locked: nobody can take a lock on it in between
        finally:
            os.close(fd)  # releases the flock
        if self._made_folder:  # taken for a run that wrote nothing (it failed first): leave no empty folder behind
            try:
                self.path.parent.rmdir()
            except OSError:  # not empty, or gone
                pass

    def holder(self) -> str | None:
        """'PID n on host h' if another lock holder holds the file now, else None; takes and creates nothing that
        lasts (a lock file that is not there is held by nobody)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # fails only beside an exclusive holder
        except BlockingIOError:
            return _describe_holder(fd)
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None or self._joined

    def __enter__(self) -> "FolderLock":
        return self if self.held else self.acquire()  # `with lock.acquire():` and `with lock:` alike

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:  # a dropped Trainer frees its folder (the OS does it anyway at exit)
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to report to
            pass


def _describe_holder(fd: int, wait_s: float = 1.0) -> str:
    """'PID n on host h' from the lock file. The holder writes its name right after taking the lock; on a loaded
    machine that can lag, so an empty or half-written file is read again for up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            info = json.loads(os.pread(fd, 4096, 0) or b"{}")
            return f"PID {info['pid']} on host {info['host']}"
        except (ValueError, KeyError, TypeError, OSError):  # between taking the lock and writing its name
            if time.monotonic() >= deadline:
                return "another process"
            time.sleep(0.02)


def run_folder_lock(folder: str | Path, hand_over: bool = False) -> FolderLock:
    """The lock of a training run folder: `<folder>/.qerl.lock` (`hand_over`: see `FolderLock`)."""
    return FolderLock(Path(folder) / ".qerl.lock", what=f"run folder {folder}", hand_over=hand_over)


def output_lock(target: str | Path, hand_over: bool = False,
                on_wait: Callable[[str], None] | None = None) -> FolderLock:
    """The lock of a folder that appears atomically (a quantized checkpoint): a sibling `.<name>.lock`, since the
    folder itself does not exist until the write succeeds (`hand_over`, `on_wait`: see `FolderLock`)."""
    target = Path(target)
    return FolderLock(target.parent / f".{target.name}.lock", what=f"output folder {target}", hand_over=hand_over,
                      on_wait=on_wait)
