"""User-facing errors: the CLI turns these into one line on stderr and an exit code (no traceback).

`UserError` (exit 2) is a mistake in the user's input; `DiskFull` (exit 1) is the machine running out of space.
"""

from __future__ import annotations

import contextlib
import errno


class UserError(ValueError):
    """A mistake in the user's input (config, paths, flags). The message names the problem and the fix.

    A ValueError, so library callers that catch bad values catch these too.
    """


class DiskFull(RuntimeError):
    """No space left on a device while writing; what was written before is intact. The CLI exits 1."""


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether `exc` (or an exception it was raised from) is a write that failed for lack of space.

    Python's own writes raise OSError(ENOSPC); tensorstore (orbax) raises ValueError("RESOURCE_EXHAUSTED: ...
    No space left on device [os_error_code='28']") from its worker threads.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(exc) or f"os_error_code='{errno.ENOSPC}'" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@contextlib.contextmanager
def disk_full_is_one_line(message: str):
    """Inside the block, a write that fails for lack of space raises DiskFull(message) instead."""
    try:
        yield
    except Exception as e:
        if not is_disk_full(e):
            raise
        raise DiskFull(message) from e


def device_out_of_memory(exc: BaseException) -> str | None:
    """XLA's message when `exc` is an accelerator running out of memory (its allocator's RESOURCE_EXHAUSTED, e.g.
    "Out of memory while trying to allocate 51.75GiB ... [executable_name='jit_train_step']"), else None. A full
    disk (orbax's RESOURCE_EXHAUSTED ... No space left on device) is not one."""
    text = str(exc)
    if "RESOURCE_EXHAUSTED" in text and "out of memory" in text.lower() and not is_disk_full(exc):
        return text
    return None


class NonFiniteLoss(RuntimeError):
    """Training produced a NaN/inf; the last good checkpoint is left as it was."""


class Preempted(RuntimeError):
    """Training stopped on SIGTERM (e.g. a preempted VM) after saving a checkpoint: the run is NOT finished.

    The CLI exits with 143 (128 + SIGTERM); rerunning the same command resumes from the saved step.
    """


class RunFailed(RuntimeError):
    """A run that `flatlm experiment --jobs N` started in a child process failed (its exit code and log tail are in
    the message); the CLI exits with 1, and the other runs' finished work is kept."""


class DamagedCheckpoint(RuntimeError):
    """A checkpoint failed its checksums or orbax's checks while being restored; it has been moved aside."""

    def __init__(self, step: int, reason: str, moved_to):
        self.step, self.reason, self.moved_to = step, reason, moved_to
        super().__init__(f"checkpoint {step} is damaged ({reason}); moved to {moved_to}")
