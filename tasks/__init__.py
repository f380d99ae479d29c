"""The reference application's orderly listeners."""

from tasks import orders  # noqa: F401
