"""Errors of the contract: one base for the package, two rejections that promise safety."""

from __future__ import annotations


class KvxferError(Exception):
    """Base of every error kvxfer raises on purpose."""


class InvalidSubmission(KvxferError):
    """The submission is wrong and will never be accepted as it stands.

    Raised for rows in no registered region, overlapping rows in one fetch, a layout or
    mode mismatch with the peer's hint, or malformed masks. Nothing escaped: no memory was
    touched and no peer was told, so the caller may end its lease at once.
    """


class SubmissionRejected(KvxferError):
    """The submission is well formed but cannot be taken now (backpressure, shut down).

    Nothing escaped: no memory was touched and no peer was told, so the caller may end its
    lease at once or try again later.
    """
