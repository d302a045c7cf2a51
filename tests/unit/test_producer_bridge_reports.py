"""How a send waits for its delivery reports: every report read, one event-loop turn, nothing left behind.

The reports are settled here by hand on the loop, as the poll thread's ``call_soon_threadsafe`` does; the
bridge's producer points at a closed local port and never sends anything. Real deliveries are covered by
the integration tests against a broker.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException
from loop_turns import turns_until

from tokcap.errors import DeliveryTimeoutError
from transports.kafka.client import producer_bridge
from transports.kafka.client.producer_bridge import Delivered, ProducerBridge, _resolve


@pytest.fixture
def bridge() -> Iterator[ProducerBridge]:
    made = ProducerBridge("127.0.0.1:1", delivery_timeout_s=0.05)
    try:
        yield made
    finally:
        made.close(timeout_s=0)


def test_a_report_reaches_the_sender_within_two_turns_of_the_loop(bridge: ProducerBridge) -> None:
    async def scenario() -> int:
        loop = asyncio.get_running_loop()
        report: asyncio.Future[Delivered] = loop.create_future()
        sender = asyncio.ensure_future(bridge._reports(loop, [report], what="put", topic="t"))
        await asyncio.sleep(0)  # the sender now awaits its report
        loop.call_soon(_resolve, report, None, Delivered(0, 7))  # what the poll thread posts
        turns = await turns_until(sender)
        assert sender.result() == [Delivered(0, 7)]
        return turns

    # wait_for(gather(...)) took four turns: the report, gather's callback, wait_for's, then the sender.
    assert asyncio.run(scenario()) <= 2


def test_a_failed_report_is_returned_in_its_place_after_every_other_report(bridge: ProducerBridge) -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        first: asyncio.Future[Delivered] = loop.create_future()
        second: asyncio.Future[Delivered] = loop.create_future()
        sender = asyncio.ensure_future(bridge._reports(loop, [first, second], what="put", topic="t"))
        _resolve(first, KafkaError(KafkaError._MSG_TIMED_OUT), None)
        for _ in range(5):
            await asyncio.sleep(0)
        assert not sender.done(), "the send must wait for the second report before failing"
        _resolve(second, None, Delivered(1, 3))
        outcomes = await sender
        assert isinstance(outcomes[0], KafkaException)
        assert outcomes[0].args[0].code() == KafkaError._MSG_TIMED_OUT
        assert outcomes[1] == Delivered(1, 3)

    asyncio.run(scenario())


def test_a_send_past_its_bound_fails_and_leaves_no_report_pending_or_unread(
    bridge: ProducerBridge, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(producer_bridge, "_ANSWER_GRACE_S", 0.0)

    async def scenario() -> list[asyncio.Future[Delivered]]:
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Delivered]] = [loop.create_future() for _ in range(3)]
        # The last report failed already; the first never comes, so the send times out waiting for it.
        _resolve(futures[2], KafkaError(KafkaError._MSG_TIMED_OUT), None)
        with bridge._produce_lock:
            bridge._waiting.update((loop, future) for future in futures)
        with pytest.raises(DeliveryTimeoutError, match="no delivery report within"):
            # Bounded here too: a bridge that never gives up would otherwise hang the test run.
            await asyncio.wait_for(bridge._reports(loop, futures, what="put", topic="t"), 5)
        assert not bridge._waiting
        return futures

    futures = asyncio.run(scenario())
    assert all(future.done() for future in futures), "a report left pending would be settled into nobody"
    del futures
    gc.collect()
    assert "never retrieved" not in caplog.text


def test_a_cancelled_sender_cancels_its_pending_reports(bridge: ProducerBridge) -> None:
    async def scenario() -> asyncio.Future[Delivered]:
        loop = asyncio.get_running_loop()
        report: asyncio.Future[Delivered] = loop.create_future()
        sender = asyncio.ensure_future(bridge._reports(loop, [report], what="put", topic="t"))
        await asyncio.sleep(0)
        sender.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sender
        return report

    assert asyncio.run(scenario()).cancelled()


class _Acknowledged:
    """What librdkafka hands ``on_delivery`` for a stored message: its partition and offset."""

    def __init__(self, partition: int, offset: int) -> None:
        self._partition, self._offset = partition, offset

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset


def test_the_reports_of_one_poll_reach_their_loop_in_one_wake_up_and_in_order(
    bridge: ProducerBridge, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> tuple[int, list[Delivered | BaseException]]:
        loop = asyncio.get_running_loop()
        wake_ups = 0
        real_post = loop.call_soon_threadsafe

        def counted(*args: Any) -> Any:
            nonlocal wake_ups
            if (
                getattr(args[0], "__module__", None) == producer_bridge.__name__
            ):  # not asyncio.to_thread's own
                wake_ups += 1
            return real_post(*args)

        monkeypatch.setattr(loop, "call_soon_threadsafe", counted)
        futures: list[asyncio.Future[Delivered]] = [loop.create_future() for _ in range(4)]
        for offset, future in enumerate(futures):  # what one poll() serves for a batch acknowledged together
            error = KafkaError(KafkaError._MSG_TIMED_OUT) if offset == 2 else None
            bridge._on_delivery(loop, future, error, _Acknowledged(0, offset))  # type: ignore[arg-type]
        await asyncio.to_thread(bridge._post_reports)
        outcomes = await asyncio.gather(*futures, return_exceptions=True)
        return wake_ups, outcomes

    wake_ups, outcomes = asyncio.run(scenario())
    assert wake_ups == 1
    assert outcomes[:2] == [Delivered(0, 0), Delivered(0, 1)] and outcomes[3] == Delivered(0, 3)
    assert isinstance(outcomes[2], KafkaException)


def test_a_report_served_while_closing_still_reaches_its_sender() -> None:
    closing = ProducerBridge("127.0.0.1:1", delivery_timeout_s=0.05)

    async def scenario() -> Delivered:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Delivered] = loop.create_future()
        # Served by close()'s flush after the poll thread's last round: nobody else will post it.
        closing._stopping.set()
        await asyncio.to_thread(closing._poller.join)
        closing._on_delivery(loop, future, None, _Acknowledged(1, 9))  # type: ignore[arg-type]
        await asyncio.to_thread(closing.close, 0)
        return await asyncio.wait_for(future, 5)

    assert asyncio.run(scenario()) == Delivered(1, 9)
