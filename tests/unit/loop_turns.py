"""Counting event-loop turns: how many a callback chain takes before an awaiting caller runs again."""

from __future__ import annotations

import asyncio
from typing import Any


async def turns_until(future: asyncio.Future[Any]) -> int:
    """How many event-loop turns pass before ``future`` is done, counted by yielding once per turn."""
    turns = 0
    while not future.done():
        await asyncio.sleep(0)
        turns += 1
    return turns
