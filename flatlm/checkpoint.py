"""Checkpoints with orbax: atomic step folders, keep-N plus pinned steps, the data iterator saved with the model.

Layout: `<workdir>/checkpoints/<step>/{state,data}`. `state` is the train state pytree
({"step", "params", "opt_state"}), `data` the grain iterator position (absent for evaluation-only loads).

Nothing lost, nothing silently wrong: after orbax commits a step folder, `<step>/flatlm_sha256.json` records the
size and sha256 of each of its files. Restoring checks them (a step saved without them, by an older flatlm or a
kill between commit and checksums, is checked by orbax's own restore only); a damaged step is moved to
`<workdir>/checkpoints_damaged/<step>` (never deleted) and reported in one line. Training then resumes from the
newest step that verifies; evaluators skip the damaged step. Running out of disk while saving raises `DiskFull`
with one line, after removing orbax's half-written temporary folder; earlier steps stay as they were.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
import threading
import time
import traceback

import grain
import jax
import orbax.checkpoint as ocp

from flatlm import paths
from flatlm.config import check_positive
from flatlm.errors import DamagedCheckpoint, DiskFull, UserError, disk_full_is_one_line, is_disk_full

MANIFEST = "flatlm_sha256.json"  # in each step folder: {"files": {relative path: {"size", "sha256"}}}
DAMAGED = "checkpoints_damaged"  # <workdir>/checkpoints_damaged/<step>: where damaged step folders go
# What orbax / tensorstore / grain raise on missing, truncated or garbled files (json errors are ValueErrors);
# orbax wraps tensorstore's in a bare Exception, so the whole chain is searched (`_damage_error`)
DAMAGE_ERRORS = (OSError, ValueError, KeyError, IndexError, TypeError)


def validate_config(checkpoint) -> None:
    """Check a config's `checkpoint` section; one line naming `checkpoint.<field>` on failure."""
    check_positive(checkpoint, "checkpoint", "every", "keep", "convergence_patience")
    if not checkpoint.log_factor > 1:  # the log-spaced steps s0 * log_factor^i would never pass the last step
        raise UserError(f"config.checkpoint.log_factor must be > 1, got {checkpoint.log_factor}")
    if not 0 <= checkpoint.convergence_tol < 1:
        raise UserError(f"config.checkpoint.convergence_tol is a relative gain in [0, 1), got "
                        f"{checkpoint.convergence_tol}")
    if not checkpoint.get("convergence_max_kl", 0.0) >= 0:
        raise UserError(f"config.checkpoint.convergence_max_kl is in nats, >= 0 (0: off), got "
                        f"{checkpoint.convergence_max_kl}")


class PinnedSteps(ocp.checkpoint_managers.PreservationPolicy):
    """Keeps checkpoints at a set of steps that may grow while training (`pin`)."""

    def __init__(self, steps=()):
        self.steps = set(int(s) for s in steps)

    def pin(self, *steps: int) -> None:
        """Keep these steps forever (in addition to the newest `keep`)."""
        self.steps.update(int(s) for s in steps)

    def should_preserve(self, checkpoints, *, context):
        """Orbax's hook: for each checkpoint, whether its step is pinned."""
        return [c.step in self.steps for c in checkpoints]


def manager(workdir: str, keep: int = 3, pinned: PinnedSteps | None = None,
            read_only: bool = False) -> ocp.CheckpointManager:
    """The run's CheckpointManager over `<workdir>/checkpoints`: keep the newest `keep` plus `pinned` steps."""
    policies = [ocp.checkpoint_managers.LatestN(keep)]
    if pinned is not None:
        policies.append(pinned)
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
        read_only=read_only,
        create=not read_only,
        enable_async_checkpointing=False,  # a step folder is committed (renamed) before training goes on
    )
    return ocp.CheckpointManager(
        paths.local_path(paths.path(workdir, "checkpoints")), options=options,
        item_handlers={"state": ocp.StandardCheckpointHandler(), "data": grain.checkpoint.CheckpointHandler()},
    )


def _sha256(path) -> str:
    with paths.path(path).open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _size(path) -> int:
    return paths.path(path).stat().length


def write_manifest(step_dir) -> None:
    """Record the size and sha256 of every file of a committed step folder in `<step_dir>/flatlm_sha256.json`,
    atomically (a temporary file, fsync, rename; in a bucket one upload)."""
    step_dir = paths.path(step_dir)
    root = os.fspath(step_dir).rstrip("/") + "/"
    files = {os.fspath(p)[len(root):]: {"size": _size(p), "sha256": _sha256(p)}
             for p in paths.files_under(step_dir) if p.name != MANIFEST and not p.name.startswith(f".{MANIFEST}")}
    paths.write_text(step_dir / MANIFEST, json.dumps({"version": 1, "files": files}), fsync=True)


def check_files(step_dir, skip: str | None = None) -> tuple[str | None, bool]:
    """(why `step_dir`'s files differ from its checksums, or None; whether it has checksums at all). Files under
    `skip` (e.g. "data/") are not checked. Files added after the checksums were written are ignored."""
    step_dir = paths.path(step_dir)
    path = step_dir / MANIFEST
    if not path.exists():
        return None, False
    try:
        files = json.loads(path.read_text())["files"]
        wanted = sorted((rel, int(f["size"]), str(f["sha256"])) for rel, f in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"its checksum file {MANIFEST} is unreadable", True
    for rel, size, digest in wanted:
        if skip is not None and rel.startswith(skip):
            continue
        top = rel.split("/")[0]
        if "/" in rel and not (step_dir / top).is_dir():
            return f"{top}/ is missing", True
        p = step_dir / rel
        if not p.exists() or p.is_dir():
            return f"{rel} is missing", True
        if _size(p) != size:
            return f"{rel} has {_size(p)} bytes, {size} were written", True
        if _sha256(p) != digest:
            return f"{rel} does not match its checksum", True
    return None, True


def move_aside(workdir, step: int) -> paths.Path:
    """Move `<workdir>/checkpoints/<step>` to `<workdir>/checkpoints_damaged/<step>` (`<step>.2`, ... if taken);
    process 0 moves, every process gets the destination."""
    root = paths.local_path(paths.path(workdir, DAMAGED))
    dest, n = root / str(step), 1
    while dest.exists():
        n += 1
        dest = root / f"{step}.{n}"
    if jax.process_index() == 0:
        root.mkdir(parents=True, exist_ok=True)
        paths.path(workdir, "checkpoints", str(step)).rename(dest)
    return dest


def _damage_error(e: BaseException | None) -> BaseException | None:
    """The innermost exception of `e`'s chain that reads like a damaged file (DAMAGE_ERRORS), else None."""
    found, seen = None, set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, DAMAGE_ERRORS):
            found = e
        e = e.__cause__ or e.__context__
    return found


def _summary(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:200]}" if first else type(e).__name__


def _verified(workdir, step: int, load, skip: str | None = None):
    """`load()` of checkpoint `step` after checking its checksums. On damage (checksums, or orbax's checks when
    there are no checksums) move the step aside and raise DamagedCheckpoint. An orbax error on files that match
    their checksums is not damage: it propagates."""
    step_dir = paths.path(workdir, "checkpoints", str(step))
    if not step_dir.is_dir():
        raise UserError(f"{workdir} has no checkpoint {step} (it has steps {all_steps(workdir) or 'none'})")
    reason, has_checksums = check_files(step_dir, skip)
    if reason is None:
        try:
            with _quiet_if_abandoned():
                return load()
        except Exception as e:
            if has_checksums or _damage_error(e) is None:
                raise
            reason = _summary(_damage_error(e))
    raise DamagedCheckpoint(step, reason, move_aside(workdir, step))


_ORBAX_DIR = f"{os.sep}orbax{os.sep}"  # in a path: a file of orbax's (its coroutines, frames, task reprs)


class _DropAbandonedOrbaxTasks(logging.Filter):
    """Drops asyncio's "Task / _GatheringFuture exception was never retrieved" records about orbax's own reads: when
    one read of a damaged checkpoint fails, orbax raises the first error and its sibling reads' failed tasks (and the
    gather futures around them) are logged by asyncio whenever they are collected (seen in CI: a second traceback on
    stderr beside the one-line report). A task names its coroutine's file; a gather future only its exception, so
    that exception's traceback is read too."""

    def filter(self, record):
        """logging's hook: False (drop) for an unretrieved exception of a task or future of orbax's."""
        message = record.getMessage()
        if "exception was never retrieved" not in message.split("\n", 1)[0]:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        return not (_ORBAX_DIR in message or _raised_in_orbax(exc))


def _raised_in_orbax(exc: BaseException | None) -> bool:
    """Whether a frame of `exc`'s traceback, or of its causes', is in a file inside orbax."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if any(_ORBAX_DIR in frame.f_code.co_filename for frame, _ in traceback.walk_tb(exc.__traceback__)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


_DROP_ABANDONED_ORBAX_TASKS = _DropAbandonedOrbaxTasks()


@contextlib.contextmanager
def _quiet_if_abandoned():
    """Run an orbax read or write. When it fails, the tensorstore callbacks of the abandoned operation still fire
    into orbax's closed event loop, and its coroutines and tasks are collected later (while training goes on from
    an older step, or at exit): they reach `sys.unraisablehook` and asyncio's logger as tracebacks around the one
    line that reports the error. Drop those: "Event loop is closed" while the call runs and after it failed; after
    a failure, orbax's own abandoned coroutines whenever they are collected, and whatever is unraisable while the
    interpreter exits; from the first call on, the unretrieved exceptions of orbax's tasks (a failed read or
    write fails the call too: it is reported by the call's own error, or caught by the checksums)."""
    previous = sys.unraisablehook
    failed = False

    def hook(unraisable):
        exc = unraisable.exc_value
        closed_loop = isinstance(exc, RuntimeError) and "Event loop is closed" in str(exc)
        abandoned = failed and (sys.is_finalizing() or _orbax_coroutine(unraisable.object))
        if not (closed_loop or abandoned):
            previous(unraisable)

    sys.unraisablehook = hook
    if _DROP_ABANDONED_ORBAX_TASKS not in logging.getLogger("asyncio").filters:  # from the start: a sibling task
        logging.getLogger("asyncio").addFilter(_DROP_ABANDONED_ORBAX_TASKS)  # may be collected before orbax raises
    try:
        yield
    except BaseException:
        failed = True  # keep the hook: the late callbacks come after the call has raised
        raise
    sys.unraisablehook = previous


def _orbax_coroutine(obj) -> bool:
    """Whether `obj` is a coroutine defined inside orbax (one of a failed read's or write's pending operations)."""
    code = getattr(obj, "cr_code", None)
    return code is not None and _ORBAX_DIR in code.co_filename


class _DropDiskFullLogs(logging.Filter):
    """Drops log records about a full disk: orbax (absl) logs each failed write, asyncio each unretrieved one."""

    def filter(self, record):
        """logging's hook: False (drop) for a record that is about running out of space."""
        return not is_disk_full(Exception(record.getMessage()))


_DROP_DISK_FULL_LOGS = _DropDiskFullLogs()


def _clean_up_failed_save(directory, step: int, quiet_s: float = 1.0, limit_s: float = 30.0) -> None:
    """Wait for the writes of a failed save that are still under way, then remove its temporary folder.

    Joining orbax's own threads is not enough: some of its writes run in asyncio's executor threads (plain
    `threading.Thread`s that stay alive idle), and one of those may (re)create a file in the folder after it is
    removed (seen once in CI). So the folder is removed until it has stayed gone for `quiet_s` seconds (at most
    `limit_s` in all)."""
    for thread in threading.enumerate():
        if type(thread).__module__.startswith("orbax") and thread is not threading.current_thread():
            thread.join(timeout=limit_s)
    start = quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < quiet_s and time.monotonic() - start < limit_s:
        leftovers = list(paths.path(directory).glob(f"{step}.orbax-checkpoint-tmp*"))
        for tmp in leftovers:
            with contextlib.suppress(OSError):  # a file created while it is removed: the next pass gets it
                tmp.rmtree()
        if leftovers:
            quiet_since = time.monotonic()
        time.sleep(0.02)


def save(mngr: ocp.CheckpointManager, step: int, state, data_iterator=None, force: bool = True) -> None:
    """Write checkpoint `step` (state and, if given, the data iterator's position), wait until committed, then
    its checksums. Out of space: DiskFull (one line), the temporary folder removed, earlier steps intact."""
    items = {"state": ocp.args.StandardSave(state)}
    if data_iterator is not None:
        items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
    directory = paths.path(mngr.directory)
    for name in ("absl", "asyncio"):  # orbax logs each failed write, asyncio each unretrieved one (later, at exit)
        if _DROP_DISK_FULL_LOGS not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(_DROP_DISK_FULL_LOGS)
    try:
        with disk_full_is_one_line(f"no space left on {directory} while writing checkpoint {step}; "
                                   "earlier checkpoints are intact"):
            with _quiet_if_abandoned():
                mngr.save(step, args=ocp.args.Composite(**items), force=force)
                mngr.wait_until_finished()
            if jax.process_index() == 0:
                write_manifest(directory / str(step))
    except DiskFull:
        _clean_up_failed_save(directory, step)
        raise


def restore(mngr: ocp.CheckpointManager, step: int, abstract_state, data_iterator=None):
    """Restore `state` with the shardings of `abstract_state` (ShapeDtypeStructs); and the iterator in place.
    No checks beyond orbax's own: `restore_latest` is the verified way in."""
    items = {"state": ocp.args.StandardRestore(abstract_state)}
    if data_iterator is not None:
        items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
    restored = mngr.restore(step, args=ocp.args.Composite(**items))
    return restored["state"]


def restore_latest(mngr: ocp.CheckpointManager, abstract_state, data_iterator=None) -> tuple[dict | None, int]:
    """(state, step) of the newest checkpoint that verifies, with the iterator restored in place; (None, 0) if
    there is none. Each damaged newer step is moved aside and reported in one line on stderr. `abstract_state` may
    be a function of the step (runs whose state changes shape, `train.stacking`)."""
    workdir = paths.path(mngr.directory).parent
    damaged: list[DamagedCheckpoint] = []
    state, start, done = None, 0, False
    try:
        for step in sorted(mngr.all_steps(), reverse=True):
            try:
                abstract = abstract_state(step) if callable(abstract_state) else abstract_state
                state = _verified(workdir, step, lambda s=step, a=abstract: restore(mngr, s, a, data_iterator))
            except DamagedCheckpoint as e:
                damaged.append(e)
                mngr.reload()  # forget the moved step: it may be written again, and must not be garbage-collected
                continue
            start = step
            break
        done = True
    finally:
        outcome = f"resuming from step {start}" if start else "no earlier checkpoint verifies; starting from step 0"
        for e in damaged:
            print(f"flatlm: {e}" + (f"; {outcome}" if done else ""), file=sys.stderr)
    return state, start


def restore_params(workdir: str, step: int, abstract_params):
    """Only the parameters of checkpoint `step` (for evaluators), placed as `abstract_params` (ShapeDtypeStructs
    with shardings) asks. The optimizer state stays on disk: a partial restore of the saved `state` item.

    Verified first (all but the data iterator's files): a damaged step is moved aside and DamagedCheckpoint
    raised, so no evaluator reads it."""
    return restore_parts(workdir, step, {"params": abstract_params})["params"]


def restore_parts(workdir: str, step: int, target: dict) -> dict:
    """The entries of the saved train state named by `target` ({"params": ..., "opt_state": ...}, each an abstract
    tree with shardings), the rest left on disk; verified first, as `restore_params`."""

    def load():
        mngr = ocp.CheckpointManager(paths.local_path(paths.path(workdir, "checkpoints")),
                                     options=ocp.CheckpointManagerOptions(read_only=True, create=False),
                                     item_handlers={"state": ocp.PyTreeCheckpointHandler()})
        try:
            restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                partial_restore=True)))
        finally:
            mngr.close()
        return restored["state"]

    return _verified(workdir, step, load, skip="data/")


def all_steps(workdir: str) -> list[int]:
    """Steps with a committed checkpoint in `workdir`, ascending ([] if none)."""
    if not paths.path(workdir, "checkpoints").exists():
        return []
    return sorted(manager(workdir, read_only=True).all_steps())
