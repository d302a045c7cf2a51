"""``tokcap staging status --bootstrap HOST:PORT --run RUN``: the staging status of a run topic.

The topic is read from the start and applied to a scratch store with the real apply step (``LogApplier``, as
``tokcap log`` and a partial replay do), so the status is the file store's status of the run's own projection:
the same rules, the same ledger. Each staged call's age is its stage message's broker timestamp (for a chunked
stage, the message that completed it). The scratch store is removed afterwards; nothing the run uses is touched.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokcap.cli.staging_status import describe_staging
from tokcap.files.store import ApplyOutcome, TokenCaptureStore
from tokcap.log.events import EventType
from transports.kafka.cli.options import parse_key_values, resolve_run_topic
from transports.kafka.client.admin import probe_broker
from transports.kafka.timeline import LogApplier, read_log

__all__ = ["topic_staging_status"]


def topic_staging_status(
    bootstrap: str,
    *,
    run_id: str | None,
    topic: str | None,
    client_options: Sequence[str],
    timeout_s: float,
    cursors: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """Staged calls not retired per rollout and pending rollouts of the run topic; ``cursors`` are the cursors
    taken, read by the caller from where the trainer's sink recorded them (the topic holds none)."""
    name = resolve_run_topic(run_id, topic)
    client_config = parse_key_values(client_options, "-X")
    probe_broker(bootstrap, client_config=client_config, timeout_s=timeout_s)
    times: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="tokcap-staging-status-") as scratch:
        applier = LogApplier.over_log(
            TokenCaptureStore(scratch), name, bootstrap, client_config=client_config, timeout_s=timeout_s
        )
        with contextlib.closing(applier):
            for message in read_log(bootstrap, name, client_config=client_config, timeout_s=timeout_s):
                for entry in applier.take_all(message):
                    if (
                        entry.event_type != EventType.STAGE.value
                        or entry.decision != ApplyOutcome.ACCEPTED.value
                    ):
                        continue
                    if message.key is not None and entry.timestamp_ms is not None:
                        key = f"{message.key.decode()}/{entry.model_call_id}"
                        times[key] = entry.timestamp_ms / 1000.0
        status = describe_staging(Path(scratch), times=times, cursors=cursors)
    status["store_dir"] = None
    status["topic"] = name
    return status
