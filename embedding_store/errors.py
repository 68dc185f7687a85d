"""Errors the embedding store raises for things a user can cause."""

from hybridrec.common.errors import UserError


class EmbeddingStoreError(UserError):
    """Base class of the embedding store's user-facing errors."""


class UnknownTableError(EmbeddingStoreError):
    """A call named a table the store was not built with."""


class InvalidInputError(EmbeddingStoreError):
    """Ids or gradients of the wrong dtype or shape."""


class CheckpointError(EmbeddingStoreError):
    """A checkpoint could not be written or read."""


class CheckpointNotFoundError(CheckpointError):
    """No committed checkpoint at the given location (or not for the given step)."""


class CheckpointCorruptedError(CheckpointError):
    """A committed checkpoint's parts are missing, truncated or fail their checksum."""


class IncompatibleCheckpointError(CheckpointError):
    """A checkpoint was written for a different table configuration (dim, optimizer, ...)."""
