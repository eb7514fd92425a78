"""Invariants are named, registered once at import, and reject misuse with a clear error."""

from __future__ import annotations

import pytest

from invariants import Invariant, InvariantError, Severity, get, strict_message

REGISTERED = Invariant("test_registry.registered", Severity.GUARD, "registered at import")


def test_an_invariant_is_registered_when_constructed():
    assert get("test_registry.registered") is REGISTERED
    assert REGISTERED.namespace == "test_registry"


def test_a_duplicate_name_is_an_error():
    with pytest.raises(InvariantError, match="already registered"):
        Invariant("test_registry.registered", Severity.SOFTEN, "again")


@pytest.mark.parametrize("name", ["nodot", "Upper.case", "trailing.", "a..b", "a.b-c", "1a.b", ""])
def test_names_must_be_dotted_lowercase_identifiers(name):
    with pytest.raises(InvariantError, match="dotted lowercase"):
        Invariant(name, Severity.SOFTEN, "bad name")


def test_severity_must_be_a_severity():
    with pytest.raises(InvariantError, match="severity"):
        Invariant("test_registry.bad_severity", "guard", "a string is not a Severity")  # type: ignore[arg-type]


def test_an_unknown_name_is_an_error():
    with pytest.raises(InvariantError, match="no invariant named"):
        get("test_registry.missing")


def test_names_too_long_for_a_device_assert_are_refused():
    with pytest.raises(InvariantError, match="too long"):
        Invariant("test_registry." + "x" * 250, Severity.SOFTEN, "long")


def test_strict_message_names_the_invariant():
    assert strict_message("swa.history_present") == "invariant-check FAILED [swa.history_present]"
