"""PII removal: recall and precision on a labelled set of real-looking text with planted PII
and look-alikes (versions, private addresses, code, hashes) that must survive."""

from __future__ import annotations

import pytest

from scaletrain.curate.documents import Document
from scaletrain.curate.pii import PIIRedactor, find_pii, luhn_ok, redact

# (text, [(kind, exact planted string), ...]); every other part of the text must survive.
LABELLED: list[tuple[str, list[tuple[str, str]]]] = [
    (
        "For questions write to maria.gonzalez@example-mail.com before Friday.",
        [("email", "maria.gonzalez@example-mail.com")],
    ),
    (
        "# Author: Barry Warsaw <barry@python.org>\n# Maintainer: fdrake@acm.org",
        [("email", "barry@python.org"), ("email", "fdrake@acm.org")],
    ),
    (
        "Reply-To: support+tickets@shop.co.uk; CC: j_smith99@uni.edu",
        [("email", "support+tickets@shop.co.uk"), ("email", "j_smith99@uni.edu")],
    ),
    (
        "The server at 8.8.4.4 answered, and 203.0.114.7 did not.",
        [("ip_address", "8.8.4.4"), ("ip_address", "203.0.114.7")],
    ),
    ("Blocked login from 185.220.101.45 at 03:14.", [("ip_address", "185.220.101.45")]),
    (
        "Resolver 2606:4700:4700::1111 and 2a00:1450:4001:82b::200e are public.",
        [("ip_address", "2606:4700:4700::1111"), ("ip_address", "2a00:1450:4001:82b::200e")],
    ),
    (
        "Call me at (415) 555-0132 or on +44 20 7946 0958 tomorrow.",
        [("phone", "(415) 555-0132"), ("phone", "+44 20 7946 0958")],
    ),
    (
        "Office: 212-555-0147, fax 212.555.0199.",
        [("phone", "212-555-0147"), ("phone", "212.555.0199")],
    ),
    (
        "Pay with 4111 1111 1111 1111 or 5500-0000-0000-0004.",
        [("credit_card", "4111 1111 1111 1111"), ("credit_card", "5500-0000-0000-0004")],
    ),
    ("amex 378282246310005 on file", [("credit_card", "378282246310005")]),
    (
        "aws_access_key_id = AKIAIOSFODNN7EXAMPLE\n"
        'aws_secret_access_key = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"',
        [
            ("secret", "AKIAIOSFODNN7EXAMPLE"),
            ("secret", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"),
        ],
    ),
    (
        "token = 'ghp_1a2B3c4D5e6F7g8H9i0JkLmNoPqRsTuVwXyZ12'",
        [("secret", "ghp_1a2B3c4D5e6F7g8H9i0JkLmNoPqRsTuVwXyZ12")],
    ),
    (
        "export OPENAI_API_KEY=sk-proj-4f9Qx2LmZ8vB7nT1rY6uK3pW0sD5aH9jE2cF",
        [("secret", "sk-proj-4f9Qx2LmZ8vB7nT1rY6uK3pW0sD5aH9jE2cF")],
    ),
    (
        "key:\n-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEAx4Ub1\nAbCdEf0123\n"
        "-----END RSA PRIVATE KEY-----\nend",
        [
            (
                "private_key",
                "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEAx4Ub1\nAbCdEf0123\n"
                "-----END RSA PRIVATE KEY-----",
            )
        ],
    ),
    # look-alikes only: nothing may change
    ("Python 3.11.7 and version 1.2.3.4 of the tool; see section 8.2.4.44 of the spec.", []),
    ("Private hosts 192.168.1.10, 10.0.0.1, 127.0.0.1, 172.16.5.4 and 0.0.0.0 stay.", []),
    ("Documentation ranges 192.0.2.1, 198.51.100.7 and 2001:db8::1 stay; so does fe80::1.", []),
    ("std::vector<int> v; auto t = 12:30:45; a[1:2:3]; x::y::z", []),
    ("@property\ndef name(self): return self._name  # decorator, not an e-mail", []),
    (
        "git commit 3f786850e387550fdab836ed7e6dc881de23001b, uuid "
        "123e4567-e89b-12d3-a456-426614174000",
        [],
    ),
    ("Dates 2024-01-15 and 15.01.2024, ISBN 978-3-16-148410-0, order 2024 0115 77.", []),
    ("Not a card: 4111 1111 1111 1112 (fails Luhn); total 1234567890123 units.", []),
    ('password = "changeme"  # too short and low entropy; user@localhost has no domain', []),
    ("pi = 3.14159265358979; big = 12345678901234567890; ratio 2.9999999999995183", []),
]


def _evaluate() -> tuple[int, int, int, list[str]]:
    tp = fp = fn = 0
    errors = []
    for text, planted in LABELLED:
        found = {(s.kind, text[s.start : s.end]) for s in find_pii(text)}
        truth = set(planted)
        tp += len(found & truth)
        fp += len(found - truth)
        fn += len(truth - found)
        errors += [f"false positive {x} in {text!r}" for x in found - truth]
        errors += [f"missed {x} in {text!r}" for x in truth - found]
    return tp, fp, fn, errors


def test_recall_and_precision_on_labelled_set() -> None:
    tp, fp, fn, errors = _evaluate()
    recall, precision = tp / (tp + fn), tp / (tp + fp)
    assert tp >= 20
    assert recall >= 0.95 and precision >= 0.95, (recall, precision, errors)


def test_look_alikes_survive_unchanged() -> None:
    for text, planted in LABELLED:
        if not planted:
            assert redact(text)[0] == text


def test_typed_placeholders_and_counts() -> None:
    text, counts = redact("mail a@b.org from 8.8.8.8 card 4111111111111111")
    assert text == "mail <EMAIL> from <IP_ADDRESS> card <CREDIT_CARD>"
    assert counts == {"email": 1, "ip_address": 1, "credit_card": 1}
    step = PIIRedactor(kinds=["email"])
    doc = step.process(Document("x", "a@b.org 8.8.8.8"))
    assert doc.text == "<EMAIL> 8.8.8.8" and step.counters["replaced_email"] == 1
    with pytest.raises(ValueError, match="PII kind"):
        PIIRedactor(kinds=["ssn"])


def test_luhn() -> None:
    assert luhn_ok("4111111111111111") and luhn_ok("378282246310005")
    assert not luhn_ok("4111111111111112")
