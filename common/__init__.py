"""What every stage package shares: config loading, user-facing errors, progress lines."""

from hybridrec.common.errors import ConfigError, UserError

__all__ = ["ConfigError", "UserError"]
