"""Gym's ``CaptureLedger`` over a run topic: ledger rows are events on the topic, read back from its projection.

A ledger row is a ``ledger`` or ``ledger-failure`` event keyed by the rollout id, like every other event. Its
writer waits until a materializer applied it, so every serving worker that waits for the rollout's partition
end reads it, and a repeat that differs from the row kept raises here. The lineage resolver (``lineage``, which
is Gym's ``CaptureLedger`` too) and engine-side staging (``staging``, which names it beside its sink and
source) both import it from here, neither from the other.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokcap.errors import ConflictingEntryError, RolloutRetiredError
from tokcap.ledger import FileCaptureLedger, PendingRollout, ledger_event, ledger_failure_event, pending_in
from tokcap.log.events import Event
from tokcap.log.state import IncompleteMark
from tokcap.metrics import source_timed
from transports.kafka.client.producer_bridge import ProducerBridge
from transports.kafka.client.topics import resolve_topic
from transports.kafka.materializer.caught_up import CaughtUpStore
from transports.kafka.private_projection import LEDGER_ONLY, PrivateProjection
from transports.kafka.sink import default_writer_id
from transports.kafka.source import KafkaTokenSource
from transports.kafka.wire.codec import encode_event_messages

if TYPE_CHECKING:
    from tokcap.lineage import LineageResolution

__all__ = ["DEFAULT_STAGE_TIMEOUT_S", "KafkaCaptureLedger"]

DEFAULT_STAGE_TIMEOUT_S = 5.0
"""How long a stage or a ledger row waits for the broker: a worker answers Gym only after it, so an unreachable
broker must fail the capture quickly (Gym then returns failed coordinates and poisons the rollout)."""


class KafkaCaptureLedger:
    """Gym's ``CaptureLedger`` over a run topic, answered from its projection in ``store_dir``.

    ``record`` returns once the broker acknowledged the row and this process's materializer applied it,
    so every reader that waits for the rollout's partition end (every serving worker) sees it, and a
    repeat that differs from the row kept raises here.

    Without ``store_dir`` (the one block every model server reads) the projection is ledger-only and lives in
    a directory this process makes for itself and removes at ``close`` (``tokcap.files.private_dirs``): it applies
    every event but the staged calls, which it passes over by their type header without decoding them
    (``LEDGER_SKIPPED_TYPES``), so its start-up and disk do not grow with the tokens staged. A ledger row is
    then judged without the staged row it names, as one whose staged row lives in another store: a row whose
    ``staging_digest`` differs from the one staged is not refused here but fails the trainer's
    ``verify_and_linearize``, and the full projection masks the rollout.
    """

    def __init__(
        self,
        *,
        bootstrap_servers: str,
        store_dir: str | Path | None = None,
        run_id: str | None = None,
        topic: str | None = None,
        delivery_timeout_s: float = DEFAULT_STAGE_TIMEOUT_S,
        producer_config: Mapping[str, Any] | None = None,
        consumer_config: Mapping[str, Any] | None = None,
        timeout_s: float = 30.0,
        writer_id: str | None = None,
    ) -> None:
        self._topic = resolve_topic(run_id, topic)
        self._writer_id = writer_id or default_writer_id()
        self._private = PrivateProjection.take(store_dir, LEDGER_ONLY, bootstrap_servers, self._topic)
        store_dir = self._private.store_dir
        try:
            self._projection = CaughtUpStore(
                bootstrap_servers=bootstrap_servers,
                topic=self._topic,
                store_dir=store_dir,
                consumer_config=consumer_config,
                timeout_s=timeout_s,
                skipped_types=self._private.skipped_types,
            )
        except BaseException:
            self._private.release()
            raise
        self._bridge = ProducerBridge(
            bootstrap_servers, delivery_timeout_s=delivery_timeout_s, producer_config=producer_config
        )
        self._files = FileCaptureLedger(store_dir)
        self._store_dir = store_dir
        self._source_settings: dict[str, Any] = {
            "bootstrap_servers": bootstrap_servers,
            "delivery_timeout_s": delivery_timeout_s,
            "producer_config": producer_config,
            "consumer_config": consumer_config,
            "timeout_s": timeout_s,
            "writer_id": self._writer_id,
        }
        self._source: KafkaTokenSource | None = None
        self._commands_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"KafkaCaptureLedger(topic={self._topic!r})"

    async def _publish(self, event: Event, what: str) -> None:
        messages = encode_event_messages(event, next_chunk_group=_rows_are_never_chunked)
        (delivered,) = await self._bridge.send(self._topic, messages, what=what)
        await asyncio.to_thread(
            self._projection.wait_applied, delivered.partition, delivered.offset, event.rollout_id
        )

    @source_timed("kafka", "record")
    async def record(self, commit: Any) -> None:
        """Record a committed call; returns once every serving worker can read it. A different repeat raises."""
        event = ledger_event(commit).model_copy(update={"writer": self._writer_id})
        call_id = event.model_call_id
        await self._publish(event, f"ledger row of call {call_id!r}")
        state = self._projection.store.read_state(event.rollout_id)
        slot = state.ledger.get(call_id)
        if slot is not None and slot.digest == event.commit_digest:
            return
        self._refused(
            event.rollout_id, call_id, "ledger row", retired=state.retired, marks=state.incomplete_marks
        )

    async def record_failure(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        """Record a call that did not commit; it never resolves a parent and poisons the rollout."""
        event = ledger_failure_event(rollout_id, model_call_id, reason).model_copy(
            update={"writer": self._writer_id}
        )
        await self._publish(event, f"ledger failure of call {model_call_id!r}")
        state = self._projection.store.read_state(rollout_id)
        if state.ledger_failures.get(model_call_id) == reason:
            return
        self._refused(
            rollout_id, model_call_id, "ledger failure", retired=state.retired, marks=state.incomplete_marks
        )

    @staticmethod
    def _refused(
        rollout_id: str, call_id: str, what: str, *, retired: bool, marks: Sequence[IncompleteMark]
    ) -> None:
        if retired:
            raise RolloutRetiredError(
                f"rollout {rollout_id!r} is retired; its fence refused the {what} of call {call_id!r}. "
                "Delete the rollout before reusing its id",
                rollout_id=rollout_id,
                model_call_id=call_id,
            )
        # The store masked the rollout for the refused row; its mark says why.
        why = next(
            (mark.reason for mark in reversed(marks) if mark.model_call_id == call_id),
            "it differs from the row already recorded for that call",
        )
        raise ConflictingEntryError(
            f"{what} of call {call_id!r} in rollout {rollout_id!r} was refused and the rollout is masked: {why}. "
            "A call id is committed once, with the row its worker staged",
            rollout_id=rollout_id,
            model_call_id=call_id,
        )

    async def manifest(self, rollout_id: str) -> dict[str, Any]:
        """The rollout's token-free ledger as plain JSON: ``records`` (Gym's ``CallRecord``) and ``failures``."""
        await asyncio.to_thread(self._projection.catch_up, rollout_id)
        return await asyncio.to_thread(self._files.manifest_now, rollout_id)

    async def has_rows(self, rollout_id: str) -> bool:
        """Whether any ledger row, committed or failed, exists for the rollout."""
        await asyncio.to_thread(self._projection.catch_up, rollout_id)
        return await asyncio.to_thread(self._files.has_rows_now, rollout_id)

    def staged_resolution(self, rollout_id: str, request_items: Sequence[Any]) -> LineageResolution | None:
        """The one committed row the request continues (Gym's custody fingerprint), read current; else ``None``."""
        self._projection.catch_up(rollout_id)
        return self._files.staged_resolution(rollout_id, request_items)

    def is_process_shared(self) -> bool:
        """True: every worker reads the same topic."""
        return True

    async def pending_rollouts(self) -> list[PendingRollout]:
        """The rollouts with at least one committed row, not retired or deleted, each saying if it has failures.

        Read once the projection holds every partition up to its end as of the call.
        """
        await asyncio.to_thread(self._projection.catch_up_all)
        return await asyncio.to_thread(pending_in, self._projection.store)

    def _commands(self) -> KafkaTokenSource:
        """The source whose retire and delete commands this ledger publishes (built on first use)."""
        with self._commands_lock:
            if self._source is None:
                self._source = KafkaTokenSource(
                    store_dir=self._store_dir,
                    topic=self._topic,
                    materializer=self._projection.materializer,
                    **self._source_settings,
                )
            return self._source

    async def retire(self, rollout_ids: Sequence[str]) -> dict[str, list[str]]:
        """Remove the rollouts' staged rows, ledger rows and records, keeping the fence (Gym main's names).

        Call it once the trainer has read every manifest row; a later ``record`` raises, and a later stage
        is dead-lettered.
        """
        payload = await self._commands().retire(list(rollout_ids))
        return {"removed": list(payload.removed), "absent": list(payload.not_found)}

    async def delete(self, rollout_ids: Sequence[str]) -> dict[str, list[str]]:
        """Remove the rollouts and their fences, so the ids can be used again."""
        payload = await self._commands().delete(list(rollout_ids))
        return {"removed": list(payload.removed), "absent": list(payload.not_found)}

    async def close(self) -> None:
        """Close the producer and hand the materializer back; calling it again is a no-op."""
        source, self._source = self._source, None
        if source is not None:
            await source.close()
        await asyncio.to_thread(self._bridge.close)
        self._projection.close()
        self._private.release()


def _rows_are_never_chunked() -> str:
    raise AssertionError("a ledger row is token-free and never reaches the chunk size")
