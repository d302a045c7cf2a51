"""Keep every value of a Kafka client configuration that could be a secret out of text tokcap emits.

librdkafka echoes configuration values in its errors ("Unsupported SASL mechanism: <value>") and log lines.
A password typed under the wrong key would be echoed there, so the key cannot decide what is secret: every
value the caller supplied is scrubbed from librdkafka's text, except values that are plainly not secrets
(numbers, booleans, librdkafka's enumerated words). Values under keys that name a secret are scrubbed always.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["REDACTED", "Redactor", "is_secret_key"]

REDACTED = "<redacted>"
"""What replaces a scrubbed value; the key it came from is named where it is known."""

_SECRET_KEY = re.compile(r"password|secret|passphrase|token|jaas|credential|\.key$|key\.pem|private", re.I)

_PLAIN_WORDS = frozenset(
    word.lower()
    for word in (
        "true",
        "false",
        "none",
        "all",
        "plaintext",
        "ssl",
        "sasl_plaintext",
        "sasl_ssl",
        "plain",
        "gssapi",
        "oauthbearer",
        "scram-sha-256",
        "scram-sha-512",
        "https",
        "earliest",
        "latest",
        "error",
        "zstd",
        "lz4",
        "gzip",
        "snappy",
        "pem",
        "der",
        "pkcs12",
        "default",
        "oidc",
        "consistent_random",
        "murmur2_random",
    )
)

_MIN_SCRUBBED_LENGTH = 3
"""Shorter values are not scrubbed from free text: replacing "ab" everywhere would garble every message.
Such values are still never printed by tokcap itself."""


def is_secret_key(key: str) -> bool:
    """Whether a configuration key names a secret by its name alone (``sasl.password``, ``ssl.key.pem``)."""
    return _SECRET_KEY.search(key) is not None


def _plain(value: str) -> bool:
    """A value nobody uses as a secret: a number, a boolean, an enumerated librdkafka word, a host:port list."""
    text = value.strip().lower()
    if text in _PLAIN_WORDS or re.fullmatch(r"-?[0-9.]+", text):
        return True
    return re.fullmatch(r"[a-z0-9.-]+:[0-9]+(,[a-z0-9.-]+:[0-9]+)*", text) is not None


class Redactor:
    """Scrubs the values of one client configuration from text; holds them, so it never shows them itself."""

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self._values: dict[str, str] = {}
        for key, value in dict(config or {}).items():
            if not isinstance(value, (str, bytes, int, float)) or isinstance(value, bool):
                continue
            text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
            if not text:
                continue
            if is_secret_key(key) or (len(text) >= _MIN_SCRUBBED_LENGTH and not _plain(text)):
                self._values[text] = key
        # Longest first, so a value containing another is replaced whole.
        self._ordered = sorted(self._values, key=len, reverse=True)

    def __repr__(self) -> str:
        """Counts the values held, never shows them."""
        return f"Redactor({len(self._values)} values)"

    @property
    def keys(self) -> Iterable[str]:
        """The keys whose values are scrubbed."""
        return sorted(set(self._values.values()))

    def scrub(self, text: str) -> str:
        """The text with every held value replaced by a placeholder naming its key."""
        for value in self._ordered:
            if value in text:
                text = text.replace(value, f"<value of {self._values[value]}, redacted>")
        return text
