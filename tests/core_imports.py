"""The top-level modules the core package may never import, for the source check and the fresh-interpreter check."""

from __future__ import annotations

__all__ = ["FORBIDDEN_ROOTS"]

FORBIDDEN_ROOTS = frozenset({"confluent_kafka", "fastapi", "ray", "torch", "aiohttp"})
