"""The one error the broker tool raises: its message says what could not be done and why."""

from __future__ import annotations


class BrokerError(RuntimeError):
    """Raised when the broker cannot be fetched, started or stopped; the message says why."""
