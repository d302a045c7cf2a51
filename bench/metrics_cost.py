"""What the metrics cost a sink call: the timing decorator alone, and file-store puts with and without it.

    python -m bench --only metrics_cost [--dir /dev/shm] [--trials 10]

The decorator (``tokcap.metrics.sink_timed``) reads the clock twice and observes one histogram bucket per call.
Its cost is measured around a coroutine that does nothing (the smallest of five trials of 100,000 calls), so
nothing else hides it. Then one store takes 1,000 puts a trial through the decorated ``put`` and through the
bare method underneath (``put.__wrapped__``, what ``functools.wraps`` exposes), trials alternating; the smallest
trial of each is reported. Run it on tmpfs for the cheapest put, where the share is largest.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench.harness import Variant, alternate
from tokcap.files.store import TokenCaptureStore
from tokcap.log.records import TokenEntry
from tokcap.metrics import sink_timed

__all__ = ["measure_metrics_cost"]

_CALLS = 100_000


async def _nothing() -> None:
    return None


def _calls(call: Callable[[], Awaitable[None]]) -> Variant:
    async def trial(_directory: Path) -> dict[str, float]:
        started = time.perf_counter()
        for _ in range(_CALLS):
            await call()
        return {"us_per_call": (time.perf_counter() - started) / _CALLS * 1e6}

    return trial


def _entries(trial: int, label: str, puts: int) -> list[TokenEntry]:
    """Distinct calls (50 rollouts, 2,000 prompt and 200 generated tokens each): every put appends a line."""
    return [
        TokenEntry(
            rollout_id=f"r{trial}-{label}-{index % 50}",
            model_call_id=f"c{index}",
            model="bench",
            prompt_token_ids=list(range(2_000)),
            generation_token_ids=list(range(200)),
            generation_log_probs=[-0.5] * 200,
        )
        for index in range(puts)
    ]


def _puts(put: Callable[[TokenEntry], Awaitable[None]], label: str, puts: int) -> Variant:
    trials = iter(range(1 << 30))

    async def trial(_directory: Path) -> dict[str, float]:
        entries = _entries(next(trials), label, puts)
        started = time.perf_counter()
        for entry in entries:
            await put(entry)
        return {"us_per_put": (time.perf_counter() - started) / puts * 1e6}

    return trial


async def measure_metrics_cost(directory: Path, puts: int, trials: int) -> dict[str, Any]:
    """The decorator around a call that does nothing, then puts into one store with and without it.

    Variants take turns; each figure is the smallest trial, the least disturbed by the rest of the machine.
    """
    timed = sink_timed("bench", "nothing")(_nothing)
    calls = await alternate({"bare": _calls(_nothing), "timed": _calls(timed)}, 5, directory)
    store = TokenCaptureStore(directory / "store")
    bare = TokenCaptureStore.put.__wrapped__  # type: ignore[attr-defined]
    try:
        variants = {
            "bare": _puts(lambda entry: bare(store, entry), "bare", puts),
            "timed": _puts(store.put, "timed", puts),
        }
        put_trials = await alternate(variants, trials, directory)
    finally:
        await store.close()
    call_us, put_us = calls.summary(min), put_trials.summary(min)
    decorator = call_us["timed"]["us_per_call"] - call_us["bare"]["us_per_call"]
    medians = {
        name: {"us_per_put": put_us[name]["us_per_put"], "us_per_call": call_us[name]["us_per_call"]}
        for name in ("bare", "timed")
    }
    medians["timed"]["decorator_us"] = decorator
    medians["timed"]["decorator_share_of_put"] = decorator / put_us["bare"]["us_per_put"]
    ratios = {
        name: {
            key: value / medians["bare"][key]
            for key, value in medians[name].items()
            if key in medians["bare"]
        }
        for name in medians
    }
    return {"medians": medians, "ratios": ratios, "runs": {"calls": calls.runs, "puts": put_trials.runs}}
