"""The two conversation hashes request-time lineage is keyed and verified by, hash for hash Gym 0.7.0's.

``assistant_fingerprint`` covers only what the model wrote (assistant turns and tool calls), so it
names the call that produced the latest model turn whatever user or tool text came after.
``conversation_digest`` covers every turn, tool results included, so a resolver can prove the context a
parent saw is unchanged before its tokens are reused.

Chat Completions, Responses and Anthropic message shapes feed the same hash input.
Each field is hashed as a one-byte tag, an 8-byte big-endian length and the UTF-8 bytes, so no two
different field sequences share a hash input.
A resolver must reproduce Gym's bytes exactly: an entry stamped by Gym's middleware is looked up with
tokcap's hashes and the other way round.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from tokcap.log.hashing import sha256_hex

__all__ = [
    "FINGERPRINT_VERSION",
    "assistant_fingerprint",
    "canonicalize_tool_arguments",
    "conversation_digest",
    "is_model_written",
]

FINGERPRINT_VERSION = 2
"""Gym's version of the hash layout; entries stamped with another version are never matched."""

_FINGERPRINT_DOMAIN = b"nemo-gym-lineage"
_CONTEXT_DOMAIN = b"nemo-gym-lineage-context"
_TEXT_BLOCK_TYPES = frozenset({"", "text", "input_text", "output_text"})
_TOOL_BLOCK_TYPES = frozenset({"tool_use", "tool_result"})


_TAGS = tuple(bytes((tag,)) for tag in range(8))


def _field(tag: int, text: str) -> bytes:
    """One tagged, length-delimited field: a tag byte, the UTF-8 length in 8 bytes big-endian, the bytes."""
    data = text.encode("utf-8")
    return _TAGS[tag] + len(data).to_bytes(8, "big") + data


def _digest(domain: bytes, fields: list[bytes]) -> str:
    """sha256 of the domain and the fields in order, hashed as one buffer (one call, not one per field)."""
    return sha256_hex(domain + b"".join(fields))


def _canonical_json(value: Any) -> str:
    """Sorted-key compact JSON of prompt content; anything not JSON-shaped is refused."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode("utf-8")
    except TypeError as exc:
        raise ValueError(f"unsupported prompt content: {type(value).__name__}") from exc


def canonicalize_tool_arguments(value: Any) -> str:
    """Tool-call arguments in one comparable form, since harnesses re-serialize them between turns.

    A JSON string is parsed and re-dumped with sorted keys; a string that is not JSON is only stripped;
    ``None`` is empty. Only the comparison uses this form; records keep the model's string.
    """
    if value is None:
        return ""
    if isinstance(value, str):
        try:
            parsed: Any = json.loads(value)
        except ValueError:
            return value.strip()
        return _canonical_json(parsed)
    return _canonical_json(value)


def _message(message: Any) -> Mapping[str, Any]:
    if type(message) is not dict and not isinstance(message, Mapping):
        raise ValueError(f"request item is not an object: {type(message).__name__}")
    return message


def is_model_written(message: Mapping[str, Any]) -> bool:
    """Assistant turns and roleless Responses ``function_call`` items; reasoning items are left out.

    A harness need not echo reasoning back, so counting it would make lookups depend on the dialect.
    """
    return message.get("role") == "assistant" or message.get("type") == "function_call"


def _content_parts(content: Any) -> list[tuple[str, str]]:
    """Typed content parts: text as itself, other blocks as canonical JSON; tool blocks are hashed elsewhere."""
    if content is None:
        return []
    if isinstance(content, str):
        return [("text", content)] if content else []
    if not isinstance(content, list):
        raise ValueError(f"unsupported message content: {type(content).__name__}")
    parts: list[tuple[str, str]] = []
    for block in content:
        if isinstance(block, str):
            if block:
                parts.append(("text", block))
            continue
        if not isinstance(block, Mapping):
            raise ValueError(f"unsupported content block: {type(block).__name__}")
        kind = str(block.get("type") or "")
        if kind in _TOOL_BLOCK_TYPES:
            continue
        text = block.get("text")
        if isinstance(text, str) and kind in _TEXT_BLOCK_TYPES:
            if text:
                parts.append(("text", text))
            continue
        if not kind:
            raise ValueError("content block has no supported type")
        parts.append((kind, _canonical_json(block)))
    return parts


def _tool_calls(message: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """``(call id, name, canonical arguments)`` of every tool call: Responses item, Anthropic block, Chat list."""
    calls: list[tuple[str, str, str]] = []
    if message.get("type") == "function_call":
        name = str(message.get("name", ""))
        if message.get("namespace"):
            name = f"{message['namespace']}__{name}"
        call_id = str(message.get("call_id") or message.get("id") or "")
        calls.append((call_id, name, canonicalize_tool_arguments(message.get("arguments"))))
    content = message.get("content")
    if isinstance(content, list):
        for block in content:
            if isinstance(block, Mapping) and block.get("type") == "tool_use":
                calls.append(
                    (
                        str(block.get("id") or ""),
                        str(block.get("name", "")),
                        canonicalize_tool_arguments(block.get("input")),
                    )
                )
    for call in message.get("tool_calls") or ():
        call = call or {}
        if not isinstance(call, Mapping):
            raise ValueError(f"unsupported tool call: {type(call).__name__}")
        function = call.get("function") or {}
        calls.append(
            (
                str(call.get("id") or ""),
                str(function.get("name", "")),
                canonicalize_tool_arguments(function.get("arguments")),
            )
        )
    return calls


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else _canonical_json(value)


def _tool_results(message: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(call id, output)`` of every tool result: Responses output item, Chat tool turn, Anthropic block."""
    results: list[tuple[str, str]] = []
    if message.get("type") == "function_call_output":
        call_id = str(message.get("call_id") or message.get("id") or "")
        results.append((call_id, _as_text(message.get("output"))))
    elif message.get("role") == "tool":
        results.append((str(message.get("tool_call_id") or ""), _as_text(message.get("content"))))
    content = message.get("content")
    if isinstance(content, list):
        for block in content:
            if isinstance(block, Mapping) and block.get("type") == "tool_result":
                call_id = str(block.get("tool_use_id") or block.get("id") or "")
                results.append((call_id, _as_text(block.get("content"))))
    return results


def assistant_fingerprint(messages: Sequence[Any] | None) -> str:
    """The lookup key of a request: a hash of its model-written turns in order; ``""`` when there are none."""
    fields: list[bytes] = []
    add = fields.append
    model_turns = 0
    for item in messages or ():
        message = _message(item)
        if not is_model_written(message):
            continue
        model_turns += 1
        content = message.get("content")
        for kind, payload in _content_parts(content):
            add(_field(0, kind))
            add(_field(1, payload))
        if _may_call_tools(message, content):
            for call_id, name, arguments in _tool_calls(message):
                add(_field(2, call_id))
                add(_field(3, name))
                add(_field(4, arguments))
    return _digest(_FINGERPRINT_DOMAIN, fields) if model_turns else ""


def conversation_digest(messages: Sequence[Any] | None) -> str:
    """A hash of every turn (role, content, tool calls and tool results); any rewrite changes it."""
    fields: list[bytes] = []
    add = fields.append
    for item in messages or ():
        message = _message(item)
        add(_field(0, str(message.get("role") or message.get("type") or "")))
        content = message.get("content")
        for kind, payload in _content_parts(content):
            add(_field(1, kind))
            add(_field(2, payload))
        if _may_call_tools(message, content):
            for call_id, name, arguments in _tool_calls(message):
                add(_field(3, call_id))
                add(_field(4, name))
                add(_field(5, arguments))
        if _may_hold_tool_results(message, content):
            for call_id, output in _tool_results(message):
                add(_field(6, call_id))
                add(_field(7, output))
    return _digest(_CONTEXT_DOMAIN, fields)


def _may_call_tools(message: Mapping[str, Any], content: Any) -> bool:
    """False only when ``_tool_calls`` finds nothing: skips building its list for a plain text turn."""
    return (
        bool(message.get("tool_calls")) or message.get("type") == "function_call" or isinstance(content, list)
    )


def _may_hold_tool_results(message: Mapping[str, Any], content: Any) -> bool:
    """False only when ``_tool_results`` finds nothing."""
    return (
        message.get("type") == "function_call_output"
        or message.get("role") == "tool"
        or isinstance(content, list)
    )
