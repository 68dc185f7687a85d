"""The error raised by input that stops the preprocessing job."""

from __future__ import annotations

from hybridrec.common.errors import UserError

INPUT_ERROR_MARK = "hybridrec-input-error"


class InputError(UserError):
    """Input that stops the job (truncated gzip, header mismatch, bad Parquet file); names the file."""

    def __init__(self, message: str):
        # The marker lets the launcher recover the message from a runner's wrapped error
        # (runners re-raise with extra text appended, sometimes through this constructor).
        if INPUT_ERROR_MARK not in message:
            message = f"[{INPUT_ERROR_MARK}] {message} [/{INPUT_ERROR_MARK}]"
        super().__init__(message)
        self.plain = message.split(f"[{INPUT_ERROR_MARK}] ", 1)[-1].split(
            f" [/{INPUT_ERROR_MARK}]"
        )[0]
