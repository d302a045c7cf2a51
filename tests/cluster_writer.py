"""A model server's capture path in its own process, for the cluster fault test.

Writes rollouts of ``CALLS`` calls (intent, then put) to the run topic and reports on stdout, one JSON line
each: ``ack`` for every acknowledged put, ``failed`` when a put failed (with how long it took), ``masked``
once the rollout's incomplete marker was acknowledged (retried until the broker takes it), ``done`` when a
rollout's calls are all acknowledged. Stops after the current call when stdin closes.

Usage: python cluster_writer.py BOOTSTRAP RUN_ID WRITER DELIVERY_TIMEOUT_S
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time

from factories import make_entry

from tokcap.errors import TokcapError
from transports.kafka import KafkaTokenSink

CALLS = 3


def report(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def main(bootstrap: str, run_id: str, writer: str, delivery_timeout_s: float) -> None:
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    sink = KafkaTokenSink(
        bootstrap_servers=bootstrap, run_id=run_id, writer_id=writer, delivery_timeout_s=delivery_timeout_s
    )
    number = 0
    try:
        while not stop.is_set():
            rollout = f"{writer}-r{number}"
            number += 1
            for call in range(CALLS):
                call_id = f"c{call}"
                try:
                    started = time.monotonic()
                    await sink.begin_call(rollout, call_id)
                    started = time.monotonic()  # each send is bounded on its own; time the one that fails
                    await sink.put(make_entry(rollout, call_id, prompt=[number, call], generation=[7]))
                except TokcapError as exc:
                    report(
                        failed=rollout,
                        call=call_id,
                        seconds=time.monotonic() - started,
                        error=type(exc).__name__,
                    )
                    for _ in range(30):  # each attempt is bounded by delivery_timeout_s
                        try:
                            await sink.mark_incomplete(rollout, call_id, "put failed")
                        except TokcapError:
                            continue
                        report(masked=rollout)
                        break
                    break
                report(ack=rollout, call=call_id)
            else:
                report(done=rollout)
            # Pace the writers so the materializer keeps up on a shared two-core machine.
            await asyncio.sleep(0.02)
    finally:
        await sink.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])))
