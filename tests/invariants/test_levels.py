"""PDSERVE_INVARIANT_CHECK sets OFF | WARN | STRICT with per-namespace overrides."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from invariants import (
    Invariant,
    InvariantError,
    InvariantViolation,
    Level,
    Severity,
    configure,
    expect,
    level_of,
    levels,
)
from invariants.levels import LevelConfig, parse

SWA = Invariant("test_levels_swa.history", Severity.GUARD, "a swa-like invariant")
SWA_DEEP = Invariant("test_levels_swa.deep.ring", Severity.GUARD, "nested namespace")
KV = Invariant("test_levels_kv.pages", Severity.GUARD, "another namespace")


def test_default_is_off_when_unset():
    assert parse("off") == LevelConfig()
    assert LevelConfig().level_for("anything.at_all") is Level.OFF


@pytest.mark.parametrize("spec,level", [("off", Level.OFF), ("warn", Level.WARN), ("STRICT", Level.STRICT)])
def test_a_bare_level_applies_to_every_invariant(spec, level):
    with levels(spec):
        assert level_of(SWA) is level and level_of(KV) is level


def test_namespace_override_wins_over_the_default():
    with levels("warn,test_levels_swa.*=strict"):
        assert level_of(SWA) is Level.STRICT
        assert level_of(SWA_DEEP) is Level.STRICT
        assert level_of(KV) is Level.WARN


def test_most_specific_rule_wins():
    with levels("off,test_levels_swa.*=warn,test_levels_swa.deep.*=strict,test_levels_swa.history=off"):
        assert level_of(SWA) is Level.OFF
        assert level_of(SWA_DEEP) is Level.STRICT
    with levels("strict,*=warn"):
        assert level_of(KV) is Level.WARN


def test_invariants_registered_later_get_the_current_level():
    with levels("off,test_levels_late.*=warn"):
        late = Invariant("test_levels_late.one", Severity.SOFTEN, "registered under a config")
        assert level_of(late) is Level.WARN


@pytest.mark.parametrize(
    "spec",
    ["loud", "warn,", ",warn", "warn,swa", "warn,swa.*=loud", "warn,Bad.*=off", "swa.*=warn,strict", " "],
)
def test_malformed_values_name_the_accepted_forms(spec):
    with pytest.raises(InvariantError, match="accepted forms"):
        parse(spec)


def test_configure_from_code_returns_the_previous_config():
    before = configure("warn")
    try:
        assert level_of(KV) is Level.WARN
    finally:
        configure(before)


def test_a_malformed_environment_fails_at_start_up():
    env = {**os.environ, "PDSERVE_INVARIANT_CHECK": "warn,swa.*=sometimes"}
    proc = subprocess.run(
        [sys.executable, "-c", "import invariants"], env=env, capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert "PDSERVE_INVARIANT_CHECK" in proc.stderr and "accepted forms" in proc.stderr


def test_the_suite_runs_at_strict_so_a_broken_invariant_fails_ci():
    # `make test` exports PDSERVE_INVARIANT_CHECK=strict; a suite silently at OFF would prove nothing.
    assert os.environ.get("PDSERVE_INVARIANT_CHECK") == "strict"
    configure(None)
    with pytest.raises(InvariantViolation, match=r"invariant-check FAILED \[test_levels_kv.pages\]"):
        expect(KV, torch.tensor([True, False]))
