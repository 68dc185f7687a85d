"""User-facing errors.

Anything a user can cause (a bad flag, a malformed file, an incompatible
checkpoint) raises `UserError` or a subclass with a message that names the
problem: the file, the line and the field where there is one. The command line
prints the message without a traceback and exits with status 2.
"""


class UserError(Exception):
    """An error caused by input or configuration, reported without a traceback."""


class ConfigError(UserError):
    """A config file or override is invalid: unknown key, wrong type, bad value."""
