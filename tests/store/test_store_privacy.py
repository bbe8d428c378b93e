"""Redaction rules: each secret type, checks that avoid false positives, token-level redaction."""

from __future__ import annotations

import pytest

from sparseety.store.privacy import (
    find_secrets,
    redact_text,
    redact_tokens,
    redact_value,
)


@pytest.mark.parametrize(
    ("secret", "placeholder"),
    [
        ("alice.smith+tag@mail.example.co.uk", "[EMAIL]"),
        ("+1 415-555-0132", "[PHONE]"),
        ("(030) 1234 5678", "[PHONE]"),
        ("4111 1111 1111 1111", "[CARD]"),
        ("5500-0000-0000-0004", "[CARD]"),
        ("192.168.10.5", "[IP]"),
        ("2001:db8::8a2e:370:7334", "[IP]"),
        ("fe80::1", "[IP]"),
        ("sk-proj-abcdefghijklmnop1234567890", "[API_KEY]"),
        ("ghp_abcdefghijklmnopqrstuvwxyz0123456789", "[API_KEY]"),
        ("AKIAIOSFODNN7EXAMPLE", "[API_KEY]"),
        ("9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08", "[API_KEY]"),
        ("dGhpcyBpcyBhIHNlY3JldCB0b2tlbiB2YWx1ZTEyMw==", "[API_KEY]"),
    ],
)
def test_each_secret_type(secret, placeholder):
    assert redact_text(f"before {secret} after.") == f"before {placeholder} after."


@pytest.mark.parametrize(
    "text",
    [
        "4111 1111 1111 1112",  # fails the Luhn check: not a card
        "The meeting is at 12:30 on 2024-05-01.",
        "pi is 3.14159 and e is 2.71828",
        "version 1.2.3 released",
        "an ordinary sentence with words only",
        "supercalifragilisticexpialidociousness",  # long, but letters only
        "order 12345 shipped",
    ],
)
def test_things_that_are_not_secrets_stay(text):
    assert redact_text(text) == text


def test_overlapping_rules_pick_one_span():
    spans = find_secrets("key sk-abcdefghijklmnop1234567890 mail a@b.io")
    assert [s.placeholder for s in spans] == ["[API_KEY]", "[EMAIL]"]
    assert spans[0].start == 4


def test_token_texts_overlapping_a_secret_get_the_placeholder():
    texts = ["Mail", " bob", "@", "corp", ".com", " now", " 192", ".168", ".1", ".7", "!"]
    redacted, masked = redact_tokens(texts)
    assert redacted == ["Mail", "[EMAIL]", "[EMAIL]", "[EMAIL]", "[EMAIL]", " now",
                        "[IP]", "[IP]", "[IP]", "[IP]", "!"]
    assert masked == {1: "[EMAIL]", 2: "[EMAIL]", 3: "[EMAIL]", 4: "[EMAIL]", 6: "[IP]", 7: "[IP]", 8: "[IP]", 9: "[IP]"}
    assert "bob" not in "".join(redacted) and "168" not in "".join(redacted)


def test_redact_value_walks_json_and_drops_text_fields():
    value = {"compare": {"dense_text": "call 415-555-0132 today", "rows": [{"note": "x@y.org"}], "n": 3}}
    assert redact_value(value) == {"compare": {"dense_text": "call [PHONE] today", "rows": [{"note": "[EMAIL]"}], "n": 3}}
    assert redact_value(value, drop_text=True) == {"compare": {"dense_text": None, "rows": [{"note": "[EMAIL]"}], "n": 3}}
