"""What every stage package shares: config loading, user-facing errors, progress lines."""

from common.errors import ConfigError, UserError

__all__ = ["ConfigError", "UserError"]
