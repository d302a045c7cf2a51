"""What the metrics cost a sink call: the timing decorator alone, and file-store puts with and without it.

    python -m bench.metrics_cost [--dir /dev/shm] [--puts 1000] [--trials 10]

The decorator (``tokcap.metrics.sink_timed``) reads the clock twice and observes one histogram bucket per call.
Its cost is measured around a coroutine that does nothing (the smallest of five runs of 100,000 calls), so
nothing else hides it. Then the same store takes puts through the decorated ``put`` and through the bare
method underneath (``put.__wrapped__``), trials alternating; the smallest trial of each is reported, as the
least disturbed by the rest of the machine. Run it on tmpfs for the cheapest put, where the share is largest.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from tokcap.metrics import sink_timed
from tokcap.records import TokenEntry
from tokcap.store import TokenCaptureStore

__all__ = ["decorator_cost_us", "main", "put_costs_us"]

_CALLS = 100_000


async def _nothing() -> None:
    return None


async def decorator_cost_us() -> float:
    """Microseconds the decorator adds to one awaited call (smallest of five runs)."""
    timed = sink_timed("bench", "nothing")(_nothing)
    costs = []
    for _ in range(5):
        runs = {}
        for label, call in (("bare", _nothing), ("timed", timed)):
            started = time.perf_counter()
            for _ in range(_CALLS):
                await call()
            runs[label] = (time.perf_counter() - started) / _CALLS
        costs.append(runs["timed"] - runs["bare"])
    return min(costs) * 1e6


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


async def put_costs_us(directory: Path, puts: int, trials: int) -> dict[str, float]:
    """Microseconds per put through the decorated and the bare method: the smallest trial of each."""
    store = TokenCaptureStore(directory)
    bare = TokenCaptureStore.put.__wrapped__  # type: ignore[attr-defined]
    calls: dict[str, Callable[[TokenEntry], Awaitable[None]]] = {
        "timed": store.put,
        "bare": lambda entry: bare(store, entry),
    }
    best = {"timed": float("inf"), "bare": float("inf")}
    try:
        for trial in range(trials):
            for label in ("timed", "bare") if trial % 2 == 0 else ("bare", "timed"):
                entries = _entries(trial, label, puts)
                started = time.perf_counter()
                for entry in entries:
                    await calls[label](entry)
                best[label] = min(best[label], (time.perf_counter() - started) / puts)
    finally:
        await store.close()
    return {label: seconds * 1e6 for label, seconds in best.items()}


def main(argv: Sequence[str] | None = None) -> int:
    """Print the decorator's cost per call and its share of a file-store put."""
    parser = argparse.ArgumentParser(prog="python -m bench.metrics_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm") if Path("/dev/shm").is_dir() else None)
    parser.add_argument("--puts", type=int, default=1_000, help="puts per trial")
    parser.add_argument("--trials", type=int, default=10, help="trials per variant, alternating")
    args = parser.parse_args(argv)

    async def run() -> None:
        decorator = await decorator_cost_us()
        with tempfile.TemporaryDirectory(dir=args.dir) as directory:
            puts = await put_costs_us(Path(directory), args.puts, args.trials)
        print(f"decorator: {decorator:.2f} us per call")
        where = args.dir or tempfile.gettempdir()
        print(f"file-store put in {where}: {puts['bare']:.1f} us bare, {puts['timed']:.1f} us timed")
        print(f"decorator / bare put: {100 * decorator / puts['bare']:.2f} %")

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
