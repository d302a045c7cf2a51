"""One broker question shared by every concurrent caller: the end offsets a resolve reads up to.

A resolve must read its rollout's partition up to the partition's end as of the call (read-your-writes), and
asking the broker costs a round trip. Callers that arrive while a question is in flight ask the next one
together, so concurrent resolves cost two round trips rather than one queued round trip each.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

from tokcap.errors import TransportError

__all__ = ["SharedQuestion"]


class SharedQuestion:
    """One broker question, for every partition asked about, answering every caller that arrived before it was sent.

    A caller that finds a question in flight adds its partition to the next one and waits for it, which is
    sent after the caller arrived: no answer is older than the call it answers (read-your-writes). Concurrent
    callers, whatever their partitions, cost two round trips rather than one queued round trip each.
    """

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._asking = False
        self._sent = 0
        self._wanted: set[int] = set()
        """The partitions the next question will ask about."""
        self._answers: dict[int, tuple[int, int | BaseException]] = {}
        """Per partition: the number of the last question that asked about it, and its answer or failure."""

    def ask(self, partition: int, question: Callable[[frozenset[int]], Mapping[int, int]]) -> int:
        """The partition's answer from a question sent after this call began (this caller's or another's)."""
        with self._condition:
            wanted = self._sent + 1
            self._wanted.add(partition)
            while self._answers.get(partition, (0, 0))[0] < wanted:
                if self._asking:
                    self._condition.wait()
                    continue
                self._asking = True
                self._sent += 1
                number, partitions = self._sent, frozenset(self._wanted)
                self._wanted = set()
                self._condition.release()
                answers: dict[int, int | BaseException] = {}
                try:
                    answered = question(partitions)
                    for asked in partitions:
                        answers[asked] = answered.get(
                            asked, TransportError(f"no end offset for partition {asked}")
                        )
                except BaseException as exc:
                    answers = dict.fromkeys(partitions, exc)
                finally:
                    self._condition.acquire()
                    self._asking = False
                    for asked in partitions:
                        self._answers[asked] = (
                            number,
                            answers.get(asked, TransportError("question not sent")),
                        )
                    self._condition.notify_all()
            answer = self._answers[partition][1]
            if isinstance(answer, BaseException):
                raise answer
            return answer
