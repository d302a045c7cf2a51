"""A call id is refused for a control character, and only for that, whatever else it holds."""

from __future__ import annotations

import sys
import unicodedata

import pytest

from tokcap.errors import InvalidInputError
from tokcap.log.input_rules import check_call_id


def test_a_call_id_is_refused_exactly_when_one_of_its_characters_is_a_control_character() -> None:
    for code in range(0x3000):
        char = chr(code)
        if 0xD800 <= code <= 0xDFFF:
            continue
        call_id = f"call-{char}-1"
        if unicodedata.category(char) == "Cc":
            with pytest.raises(InvalidInputError):
                check_call_id("r", call_id)
        else:
            assert check_call_id("r", call_id) == call_id
    assert check_call_id("r", "x" + chr(sys.maxunicode)) == "x" + chr(sys.maxunicode)
