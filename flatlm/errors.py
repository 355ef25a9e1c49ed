"""User-facing errors: the CLI turns these into one line on stderr and exit code 2 (no traceback)."""


class UserError(Exception):
    """A mistake in the user's input (config, paths, flags). The message names the problem and the fix."""
