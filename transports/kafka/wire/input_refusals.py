"""What the sinks' input rules refuse, as a reader sees it: an ``EventDecodeError`` that names the field.

Every event a reader decodes passes the input rules a sink applies before sending (``tokcap.log.input_rules``):
what a sink would have refused to send is refused the same way when it is read, and dead-lettered.
"""

from __future__ import annotations

from tokcap.errors import EventDecodeError, InvalidInputError, NewerSchemaError
from tokcap.log.checked_puts import accept_put_or_event
from tokcap.log.events import Event

__all__ = ["accepted", "refused"]


def refused(exc: InvalidInputError) -> EventDecodeError:
    """A refusal by the sinks' input rules as an ``EventDecodeError`` that names the field.

    Every reader then dead-letters the message, or passes over it, as it does any message it cannot apply.
    (Plain ``try`` blocks call this rather than a context manager, which would cost a microsecond per event.)
    """
    return EventDecodeError(
        f"refused by the input rules: {exc}", rollout_id=exc.rollout_id, model_call_id=exc.model_call_id
    )


def accepted(raw: object, *, token_ids_checked: bool) -> Event:
    """The event decoded JSON stands for, if it passes the sinks' input rules (``accept_put_or_event``)."""
    try:
        return accept_put_or_event(raw, token_ids_checked=token_ids_checked)
    except (EventDecodeError, NewerSchemaError):
        raise
    except InvalidInputError as exc:
        raise refused(exc) from exc
