"""Which incarnation of its run topic a store directory is bound to, and the watch that keeps it so.

Deleting a topic and creating it again under the same name gives a new topic whose offsets start again at 0.
A checkpoint saying "offset 10 is next" means nothing there: resuming at it would skip the new topic's first
ten events without a trace. The broker gives each topic an id when it is created, so checkpoints and owner
records carry that id (``topic_id``) next to the topic's name, and a directory is refused, before anything is
applied, when its records name another id than the topic has now.

Records written before they carried an id have none; the first materializer to start on such a directory
binds it to the topic as it is then, by writing the id into every record (``docs/operations.md`` says how to
check that this is the right topic first). A directory is bound once; nothing rebinds it to another id.

A running materializer cannot see the change in what it reads (the consumer goes on fetching at its offset
in the new topic without an error), so ``IncarnationWatch`` reads the id again at a short interval and
whenever reading looks wrong (an error, an offset out of sequence), and the materializer stops on a change.
A command (freeze, drop, retire, delete) is answered only after a read of the id that began after the
command was fetched (``confirm_since``): a read that still finds the bound id proves no new incarnation
existed when the command was fetched, so no source is answered from a topic created again.
This module imports no Kafka client: the id is read by the callable it is given.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from tokcap.errors import TransportError
from transports.kafka.errors import MaterializerFailedError, TopicIncarnationError, TopicNotFoundError

__all__ = [
    "TOPIC_CHECK_S",
    "IncarnationWatch",
    "check_incarnation",
    "logger",
    "other_incarnation",
]

logger = logging.getLogger(__name__)

TOPIC_CHECK_S = 0.5
"""How often a running materializer reads its topic's id again: one metadata request, about a millisecond."""


def other_incarnation(what: str, topic: str, recorded: str, current: str | None) -> TopicIncarnationError:
    """The refusal of ``what`` (a file, a directory) bound to id ``recorded`` of ``topic``, which is now ``current``.

    ``current`` is ``None`` when the topic no longer exists.
    """
    now = f"has id {current}" if current is not None else "no longer exists"
    return TopicIncarnationError(
        f"{what} was written from topic {topic!r} with topic id {recorded}, but topic {topic!r} now {now}: the "
        "topic was deleted and created again, and the new topic's offsets start again at 0, so resuming here "
        "would skip its events. Materialize (or `tokcap replay`) the new topic into a new, empty directory; "
        "keep this one only to read the old run"
    )


def check_incarnation(what: str, topic: str, recorded: str | None, current: str) -> None:
    """Refuse a record bound to another id than ``current``; one without an id (an older record) passes."""
    if recorded is not None and recorded != current:
        raise other_incarnation(what, topic, recorded, current)


class IncarnationWatch:
    """Reads the topic's id in a background thread and remembers the first change seen.

    ``read_id`` returns the id or raises ``TopicNotFoundError`` while no topic has the name; any other
    transport error is logged and retried at the next check. A topic missing for a while is not a change by
    itself (no offsets are read meanwhile); one that comes back with another id is.
    """

    def __init__(
        self, topic: str, bound_id: str, read_id: Callable[[], str], interval_s: float | None = None
    ) -> None:
        """``interval_s`` is the time between two reads of the id; ``TOPIC_CHECK_S`` by default."""
        self._topic = topic
        self._bound_id = bound_id
        self._read_id = read_id
        self._interval_s = TOPIC_CHECK_S if interval_s is None else interval_s
        self._lock = threading.Lock()
        self._failure: TopicIncarnationError | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._missing_logged = False
        self._unread_logged = False
        self._confirmed_at = float("-inf")
        """When the last read that found the bound id began (``time.monotonic``)."""
        self._confirm_lock = threading.Lock()

    def __repr__(self) -> str:
        """The topic and the id it is bound to."""
        return f"IncarnationWatch(topic={self._topic!r}, bound_id={self._bound_id!r})"

    @property
    def bound_id(self) -> str:
        """The id of the incarnation the directory is bound to."""
        return self._bound_id

    def start(self) -> None:
        """Check in a daemon thread until ``stop``."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"tokcap-topic-watch-{self._topic}", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        """End the checks; idempotent."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(5.0)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.check_now()
            if self.failure is not None:
                return

    def confirm_since(self, fetched_at: float, stop: threading.Event | None = None) -> None:
        """Return once a read that began after ``fetched_at`` found the bound id; raise on a change.

        While the id cannot be read (the broker is away, the topic is missing) this keeps asking: waiting is
        safe, answering unproven is not. It gives up only when ``stop`` is set, raising
        ``MaterializerFailedError``.
        """
        with self._confirm_lock:
            while self._confirmed_at < fetched_at:
                self.check_now()
                self.raise_if_changed()
                if self._confirmed_at >= fetched_at:
                    return
                if stop is not None and stop.wait(0.2):
                    raise MaterializerFailedError(
                        f"stopped before the id of topic {self._topic!r} could be read again; the commands "
                        "read last were not answered"
                    )
                if stop is None:
                    time.sleep(0.2)

    def check_now(self) -> TopicIncarnationError | None:
        """Read the id once, now; return the change if there is one (also remembered for ``raise_if_changed``)."""
        began = time.monotonic()
        try:
            current = self._read_id()
        except TopicNotFoundError:
            if not self._missing_logged:
                logger.warning("topic %s is gone from the broker; reading waits for it", self._topic)
                self._missing_logged = True
            return self.failure
        except TransportError as exc:
            if not self._unread_logged:
                logger.warning("could not read the id of topic %s (asking again): %s", self._topic, exc)
                self._unread_logged = True
            return self.failure
        self._missing_logged = self._unread_logged = False
        if current == self._bound_id:
            with self._lock:
                self._confirmed_at = max(self._confirmed_at, began)
        else:
            with self._lock:
                if self._failure is None:
                    self._failure = other_incarnation(
                        "the store directory being materialized", self._topic, self._bound_id, current
                    )
        return self.failure

    @property
    def failure(self) -> TopicIncarnationError | None:
        """The change seen, once one was."""
        with self._lock:
            return self._failure

    def raise_if_changed(self) -> None:
        """Raise the change seen, if any."""
        failure = self.failure
        if failure is not None:
            raise failure
