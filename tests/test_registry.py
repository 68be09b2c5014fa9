"""Each method's card is its one declaration of what its two sides share, and the registry indexes
every card."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

from fedskew import methods, wire
from fedskew.client_app.base import BaseTrainer
from fedskew.methods.card import MethodSpec
from fedskew.registry import METHODS
from fedskew.schema import Param
from fedskew.strategies.base import BaseStrategy


@pytest.mark.parametrize("name", sorted(METHODS))
def test_strategy_and_trainer_read_one_wire(name: str) -> None:
    """A method's strategy and trainer take their `wire` from its card, the same `Wire` object, and
    no class on either side declares one of its own (a second declaration could drift)."""
    spec = METHODS[name]
    assert isinstance(spec.wire, wire.Wire), f"{name}: wire={spec.wire!r} is no fedskew.wire.Wire"
    for cls, base in ((spec.strategy_class(), BaseStrategy), (spec.trainer_class(), BaseTrainer)):
        owners = [c.__qualname__ for c in cls.__mro__ if "wire" in vars(c)]
        assert owners == [base.__qualname__], f"{name}: {cls.__qualname__}'s wire is declared by {owners}"
        assert cls.wire is spec.wire, f"{name}: {cls.__qualname__} reads another wire"
        assert cls.__new__(cls).wire is spec.wire  # an instance's lookup too (no model, no data)


def test_every_card_is_indexed() -> None:
    """Every module of `fedskew/methods/` but the card type is one method's card, indexed under its
    name, and its `WIRE`, when it declares one, is the card's wire; `fedskew.wire` itself declares
    none but the base one (no stale or second declaration)."""
    cards = [m.name for m in pkgutil.iter_modules(methods.__path__) if m.name != "card"]
    assert len(cards) == len(METHODS)
    for module_name in cards:
        card = importlib.import_module(f"fedskew.methods.{module_name}")
        assert METHODS[card.METHOD.name] is card.METHOD, module_name
        assert card.METHOD.name.replace("-", "_") == module_name
        if hasattr(card, "WIRE"):
            assert card.METHOD.wire is card.WIRE, module_name
    assert [k for k, v in vars(wire).items() if isinstance(v, wire.Wire)] == ["BASE"]


def test_a_card_refuses_keys_without_its_prefix() -> None:
    """A key is found by its method's name (`git grep fedrs-alpha`): a card whose key lacks the
    prefix is refused when it is made."""
    with pytest.raises(ValueError, match=r"keys \['alpha'\] do not start with 'fedrs-'"):
        MethodSpec("fedrs", "m:S", "m:T", params={"alpha": Param(float, 0.5, "a key without its prefix")})
