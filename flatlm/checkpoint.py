"""Checkpoints with orbax: atomic step folders, keep-N plus pinned steps, the data iterator saved with the model.

Layout: `<workdir>/checkpoints/<step>/{state,data}`. `state` is the train state pytree
({"step", "params", "opt_state"}), `data` the grain iterator position (absent for evaluation-only loads).
"""

from __future__ import annotations

from pathlib import Path

import grain
import orbax.checkpoint as ocp

from flatlm.config import check_positive


def validate_config(checkpoint) -> None:
    """Check a config's `checkpoint` section; one line naming `checkpoint.<field>` on failure."""
    check_positive(checkpoint, "checkpoint", "every", "keep")


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
        Path(workdir, "checkpoints").absolute(), options=options,
        item_handlers={"state": ocp.StandardCheckpointHandler(), "data": grain.checkpoint.CheckpointHandler()},
    )


def save(mngr: ocp.CheckpointManager, step: int, state, data_iterator=None, force: bool = True) -> None:
    """Write checkpoint `step` (state and, if given, the data iterator's position) and wait until committed."""
    items = {"state": ocp.args.StandardSave(state)}
    if data_iterator is not None:
        items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
    mngr.save(step, args=ocp.args.Composite(**items), force=force)
    mngr.wait_until_finished()


def restore(mngr: ocp.CheckpointManager, step: int, abstract_state, data_iterator=None):
    """Restore `state` with the shardings of `abstract_state` (ShapeDtypeStructs); and the iterator in place."""
    items = {"state": ocp.args.StandardRestore(abstract_state)}
    if data_iterator is not None:
        items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
    restored = mngr.restore(step, args=ocp.args.Composite(**items))
    return restored["state"]


def restore_params(workdir: str, step: int, abstract_params):
    """Only the parameters of checkpoint `step` (for evaluators), placed as `abstract_params` (ShapeDtypeStructs
    with shardings) asks. The optimizer state stays on disk: a partial restore of the saved `state` item."""
    mngr = ocp.CheckpointManager(Path(workdir, "checkpoints").absolute(),
                                 options=ocp.CheckpointManagerOptions(read_only=True, create=False),
                                 item_handlers={"state": ocp.PyTreeCheckpointHandler()})
    target = {"params": abstract_params}
    restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True)))
    mngr.close()
    return restored["state"]["params"]


def all_steps(workdir: str) -> list[int]:
    """Steps with a committed checkpoint in `workdir`, ascending ([] if none)."""
    if not Path(workdir, "checkpoints").exists():
        return []
    return sorted(manager(workdir, read_only=True).all_steps())
