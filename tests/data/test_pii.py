"""PII scrubbing: every kind becomes its placeholder and is counted; look-alikes stay."""

from __future__ import annotations

import pytest

from lathe.data.document import Document
from lathe.data.stages.pii import PII, PIIConfig

KEY = ("-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA1c7+9z5Pad7OejecsQ0bu3aumgs\n"
       "-----END RSA PRIVATE KEY-----")


@pytest.mark.parametrize("kind, text, placeholder", [
    ("email", "write to jane.doe+news@example.co.uk today", "<EMAIL>"),
    ("ip", "the server at 8.8.4.4 answered", "<IP_ADDRESS>"),
    ("ip", "or at 2001:4860:4860::8888 over IPv6", "<IP_ADDRESS>"),
    ("phone", "call +1 (415) 555-2671 now", "<PHONE>"),
    ("phone", "call 020 7946 0958 now", "<PHONE>"),
    ("secret", "aws_key = AKIAIOSFODNN7EXAMPLE", "<SECRET>"),
    ("secret", "token ghp_" + "a1B2" * 9 + " here", "<SECRET>"),
    ("secret", "slack xoxb-123456789012-abcdefABCDEF here", "<SECRET>"),
    ("private_key", f"key:\n{KEY}\nend", "<PRIVATE_KEY>"),
])
def test_each_kind_is_replaced_and_counted(kind, text, placeholder):
    doc = Document("d", text)
    verdict = PII(PIIConfig())(doc)
    assert placeholder in doc.text
    assert verdict.edits == {kind: 1}


def test_private_addresses_are_kept_unless_asked():
    text = "router 192.168.1.1, loopback 127.0.0.1 and ::1, docs 10.0.0.7"
    doc = Document("d", text)
    assert PII(PIIConfig())(doc).edits == {} and doc.text == text
    doc = Document("d", text)
    assert PII(PIIConfig(only_public_ips=False))(doc).edits == {"ip": 4}


def test_lookalikes_are_not_scrubbed():
    text = "version 3.11.7, ratio 1:2, time 12:30:45, x = a@b, year 2024, id 12345678"
    doc = Document("d", text)
    assert PII(PIIConfig())(doc).edits == {}
    assert doc.text == text


def test_kinds_can_be_selected_and_unknown_kinds_are_rejected():
    doc = Document("d", "mail jane@example.com from 8.8.8.8")
    assert PII(PIIConfig(kinds=["email"]))(doc).edits == {"email": 1}
    assert "8.8.8.8" in doc.text
    from lathe.core.errors import ConfigError

    with pytest.raises(ConfigError, match="pii.kinds"):
        PII(PIIConfig(kinds=["ssn"]))
