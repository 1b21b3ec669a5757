"""The one exception a user can cause: bad arguments, bad config. The CLI prints it and exits 2."""


class UsageError(Exception):
    """A usage or configuration error: one line on stderr, exit status 2."""
