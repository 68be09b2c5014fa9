"""The registry is each method's one declaration of what its two sides share."""

from __future__ import annotations

import pytest

from fedskew import wire
from fedskew.client_app.base import BaseTrainer
from fedskew.registry import METHODS
from fedskew.strategies.base import BaseStrategy


@pytest.mark.parametrize("name", sorted(METHODS))
def test_strategy_and_trainer_read_one_wire(name: str) -> None:
    """A method's strategy and trainer take their `wire` from its registry entry, the same `Wire`
    object, and no class on either side declares one of its own (a second declaration could drift)."""
    spec = METHODS[name]
    declared = spec.wire_spec()
    assert isinstance(declared, wire.Wire), f"{name}: wire={spec.wire!r} names no fedskew.wire.Wire"
    for cls, base in ((spec.strategy_class(), BaseStrategy), (spec.trainer_class(), BaseTrainer)):
        owners = [c.__qualname__ for c in cls.__mro__ if "wire" in vars(c)]
        assert owners == [base.__qualname__], f"{name}: {cls.__qualname__}'s wire is declared by {owners}"
        assert cls.wire is declared, f"{name}: {cls.__qualname__} reads another wire"
        assert cls.__new__(cls).wire is declared  # an instance's lookup too (no model, no data)


def test_every_named_wire_is_used() -> None:
    """Every method-specific `Wire` in `fedskew.wire` is some registered method's (no stale one)."""
    named = {k for k, v in vars(wire).items() if isinstance(v, wire.Wire)}
    used = {spec.wire for spec in METHODS.values()}
    assert used <= named
    assert {id(getattr(wire, k)) for k in named} == {id(getattr(wire, k)) for k in used}
