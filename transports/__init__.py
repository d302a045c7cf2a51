"""Transports carrying capture records between processes and nodes; each lives in its own subpackage."""

__all__: list[str] = []
