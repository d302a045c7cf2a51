"""A loop that runs in a thread of its own (``start``/``stop``) or in the caller's (``run_until_stopped``).

Its failure is kept by its waiter registry, which ends every wait on it, and raised again to whoever started or
runs it: a specific stop (another topic incarnation, an offset gap, another owner) keeps its class.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod

from transports.kafka.errors import (
    MaterializerFailedError,
    MaterializerOwnedElsewhereError,
    TopicLimitsMismatchError,
)
from transports.kafka.materializer.waiters import WaiterRegistry

__all__ = ["LoopThread"]


class LoopThread(ABC):
    """The lifecycle of a materializer's loop: subclasses give ``_run`` and set ``_ready`` once it runs."""

    def __init__(self, name: str, topic: str, waiters: WaiterRegistry) -> None:
        self._loop_name = name
        self._loop_topic = topic
        self._waiters = waiters
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    def start(self) -> None:
        """Run in a background thread until ``stop``; returns once partitions are assigned."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run_guarded, name=self._loop_name, daemon=True)
        self._thread.start()
        self._ready.wait()
        self._raise_if_failed()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish the current batch, write its checkpoint and stop; idempotent."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)

    def run_until_stopped(self) -> None:
        """Run in the calling thread until ``request_stop`` (or a signal handler calling it)."""
        self._run_guarded()
        self._raise_if_failed()

    def request_stop(self) -> None:
        """Ask the loop to stop after its current batch; safe from a signal handler."""
        self._stop.set()

    @abstractmethod
    def _run(self) -> None:
        """Run the loop until ``_stop`` is set, in whichever thread called it.

        A subclass sets ``_ready`` once the loop runs (``start`` returns then; it is set anyway when ``_run``
        returns or raises), checks ``_stop`` between batches and returns soon after it is set, and raises
        rather than returns on a failure: the failure ends every wait and is raised again to the caller.
        """

    def _raise_if_failed(self) -> None:
        failure = self._waiters.failure
        if isinstance(failure, MaterializerOwnedElsewhereError | TopicLimitsMismatchError):
            raise failure
        if failure is not None:
            # A specific stop (another topic incarnation, an offset gap) keeps its class for the caller.
            kind = type(failure) if isinstance(failure, MaterializerFailedError) else None
            raise (kind or MaterializerFailedError)(
                f"the materializer of topic {self._loop_topic!r} stopped: {failure}"
            ) from failure

    def _run_guarded(self) -> None:
        try:
            self._run()
        except BaseException as exc:
            if isinstance(exc, MaterializerOwnedElsewhereError):
                logging.getLogger(type(self).__module__).info("%s", exc)
            else:
                logging.getLogger(type(self).__module__).exception(
                    "materializer of topic %s failed", self._loop_topic
                )
            self._waiters.fail(exc)
        finally:
            self._ready.set()
