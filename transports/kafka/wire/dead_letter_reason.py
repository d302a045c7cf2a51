"""How much of a refusal's reason a dead letter keeps; the reason quotes message content."""

__all__ = ["REASON_LIMIT"]

REASON_LIMIT = 600
"""Longest reason kept in a dead-letter line or an incomplete mark; a reason quotes message content."""
