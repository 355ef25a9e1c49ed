"""User-facing errors: the CLI turns these into one line on stderr and exit code 2 (no traceback)."""


class UserError(ValueError):
    """A mistake in the user's input (config, paths, flags). The message names the problem and the fix.

    A ValueError, so library callers that catch bad values catch these too.
    """
