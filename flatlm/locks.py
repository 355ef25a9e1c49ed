"""Inter-process file locks (`fcntl.flock`, Linux and macOS) so that concurrent flatlm processes never lose or
mix up each other's writes.

Two kinds, both re-entrant within one process (the thread that holds a lock may take it again; other threads
of the process are treated as other processes are; a child forked while a lock is held shares it):

- `exclusive(directory, what)`: the workdir lock `<directory>/.lock`, held for a whole command (train, evaluate,
  flatness, experiment). One lock per workdir for any writer: evaluating a run that is being trained is refused
  as well. A second process does not wait: it gets a `UserError` naming the holder's pid and what it is doing.
- `waiting(path, what)`: a blocking lock on the file `path` for a critical section (a read-modify-write of
  results.json, building a dataset). With `announce=True` a process that has to wait prints one line to stderr
  naming the pid it waits for.

The holder writes {"pid", "what"} into the lock file; the file is only ever read for messages. The OS releases
a lock when its holder dies (even by SIGKILL), so a stale pid left in a file never blocks anyone. Lock files
live next to what they protect and are not results.

A workdir in a bucket (gs://, s3://) has no lock: flock works on a local file system only, and an object store has
no primitive that a killed holder releases. `exclusive` then logs one warning that it cannot keep a second writer
out, and `waiting` does nothing, so on a cloud workdir the rule "one writer per workdir" is the user's to keep
(e.g. one job per run, as `launch/tpu.sh` starts them); two writers there can lose each other's results entries.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from flatlm.errors import UserError

LOCK = ".lock"  # the workdir lock's file name


class _Held:
    """This process's hold on one lock file: a thread lock (for the threads of this process) and the flock."""

    def __init__(self):
        self.thread_lock = threading.RLock()
        self.fd: int | None = None
        self.depth = 0


_registry_guard = threading.Lock()
_held: dict[str, _Held] = {}  # lock file (absolute) -> this process's hold on it
_warned: set[str] = set()  # cloud workdirs already warned about (once per process)


def holder(path) -> tuple[int, str] | None:
    """(pid, what) of the live process that wrote the lock file `path`; None if it is empty or names a dead one."""
    try:
        info = json.loads(Path(path).read_text() or "{}")
        pid, what = int(info["pid"]), str(info["what"])
        os.kill(pid, 0)  # the holder writes after taking the lock: a dead pid here is a previous holder's
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return pid, what


def _describe(path: Path) -> str:
    h = holder(path)
    return f"another flatlm process (pid {h[0]}) is {h[1]}" if h else f"another flatlm process holds {path}"


def _flock(path: Path, what: str, block: bool, on_wait) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not block:
                raise
            on_wait(path)
            fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    try:  # who holds it, for the other process's message; the lock itself works without it (e.g. a full disk)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "what": what}).encode(), 0)
    except OSError:
        pass
    return fd


@contextlib.contextmanager
def _lock(path: Path, what: str, block: bool, on_wait=None) -> Iterator[None]:
    """The lock; BlockingIOError at once if `block` is False and another process (or thread) holds it."""
    key = os.path.abspath(path)
    with _registry_guard:
        held = _held.setdefault(key, _Held())
    if not held.thread_lock.acquire(blocking=block):
        raise BlockingIOError(f"{path} is held by another thread of this process")
    try:
        if held.depth == 0:
            held.fd = _flock(Path(key), what, block, on_wait)
        held.depth += 1
        try:
            yield
        finally:
            held.depth -= 1
            if held.depth == 0:
                os.ftruncate(held.fd, 0)  # leave no pid of ours behind for the next holder's waiters to read
                os.close(held.fd)  # releases the flock
                held.fd = None
    finally:
        held.thread_lock.release()


def _local(path) -> bool:
    return "://" not in os.fspath(path)


@contextlib.contextmanager
def exclusive(directory, what: str, enabled: bool = True) -> Iterator[None]:
    """Hold `<directory>/.lock` for the `with` block, or raise `UserError` at once if another process holds it.

    `what` says what the holder does ("training", "evaluating", ...); the other process's message names it.
    `enabled=False` (e.g. on processes other than 0 of a multi-host run) takes no lock.
    """
    if not enabled:
        yield
        return
    if not _local(directory):
        if os.fspath(directory) not in _warned:
            _warned.add(os.fspath(directory))
            logging.getLogger("flatlm").warning(
                "flatlm: %s is in a bucket, which has no file locks: nothing stops a second process from writing "
                "there too; run one writer per workdir", directory)
        yield
        return
    path = Path(directory, LOCK)
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(_lock(path, f"{what} in {directory}", block=False))
    except BlockingIOError:
        raise UserError(f"{_describe(path)}; a workdir takes one writer at a time (train, evaluate, flatness, "
                        "experiment): wait for it to finish or use another --workdir") from None
    with stack:
        yield


@contextlib.contextmanager
def waiting(path, what: str, announce: bool = False) -> Iterator[None]:
    """Hold the lock file `path` for the `with` block, waiting as long as another process holds it.

    `what` says what the holder does. With `announce`, a process that has to wait first prints one line to
    stderr naming the pid it waits for.
    """
    if not _local(path):
        yield
        return

    def on_wait(lock_file: Path) -> None:
        if announce:
            print(f"flatlm: waiting: {_describe(lock_file)}", file=sys.stderr, flush=True)

    with _lock(Path(path), what, block=True, on_wait=on_wait):
        yield
