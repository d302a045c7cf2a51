"""A child process that writes entries to a store and reports each acknowledged one on stdout.

Used by the multi-process and crash tests: a line is printed only after ``append`` returned,
so every printed call id is an acknowledged, durable entry.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.factories import make_entry
from tokcap.files.store import TokenCaptureStore


def main() -> None:
    root, worker, rollouts, count, prompt_len = (
        sys.argv[1],
        sys.argv[2],
        sys.argv[3].split(","),
        int(sys.argv[4]),
        int(sys.argv[5]),
    )
    store = TokenCaptureStore(root)
    for n in range(count):
        rollout_id = rollouts[n % len(rollouts)]
        call_id = f"{worker}-{n}"
        store.begin_call_now(rollout_id, call_id)
        store.append(
            make_entry(rollout_id, call_id, prompt=range(n % 7, n % 7 + prompt_len), generation=(n, n + 1))
        )
        print(f"{rollout_id} {call_id}", flush=True)


if __name__ == "__main__":
    main()
