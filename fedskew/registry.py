"""The index of the methods: each method's card (`fedskew/methods/<name>.py`: its strategy, its
trainer, its run-config keys, its wire and its paper) under its name, in the order `fedskew config`
lists them. Adding a method adds its card and its name twice here (the import, its place in the order).

Its strategy and trainer classes are imported by dotted path only when asked, so that the config
validator lists the methods and their keys without importing torch.
"""

from __future__ import annotations

import functools
from typing import Any

from fedskew.methods import (
    creff,
    ditto,
    fedavg,
    fedavgm,
    fedaws,
    fedbabu,
    feddc,
    feddyn,
    fedgela,
    fedgen,
    fedlc,
    fedmmd,
    fedmr,
    fednova,
    fedphp,
    fedproc,
    fedproto,
    fedprox,
    fedrep,
    fedrod,
    fedrs,
    moon,
    mupfl,
    scaffold,
    scaffold_rs,
)
from fedskew.methods import map as map_card  # `map` would hide the builtin
from fedskew.methods.card import MethodSpec
from fedskew.wire import BASE, Wire

METHODS: dict[str, MethodSpec] = {
    card.METHOD.name: card.METHOD
    for card in (
        fedavg,
        fedprox,
        fedavgm,
        fedrs,
        scaffold,
        scaffold_rs,
        fednova,
        feddyn,
        feddc,
        fedmr,
        mupfl,
        map_card,
        fedphp,
        fedproto,
        fedgela,
        moon,
        fedproc,
        fedlc,
        fedmmd,
        fedaws,
        fedgen,
        creff,
        ditto,
        fedrep,
        fedbabu,
        fedrod,
    )
}


def config_keys(method: MethodSpec) -> set[str]:
    """The method keys a run of `method` can read: its own and those of every registered method
    whose own strategy or trainer class (one that no other method uses as is) its classes inherit
    from: MAP's trainer subclasses FedRS's, so the fedrs- keys count for MAP, while FedAvgM, which
    uses FedAvg's trainer as is, adds nothing to FedAvg's keys. The common keys are not included."""
    mine = {*method.strategy_class().__mro__, *method.trainer_class().__mro__}
    users: dict[Any, int] = {}
    for m in METHODS.values():
        for c in {m.strategy_class(), m.trainer_class()}:
            users[c] = users.get(c, 0) + 1
    keys = set(method.params)
    for other in METHODS.values():
        if any(c in mine and users[c] == 1 for c in (other.strategy_class(), other.trainer_class())):
            keys |= set(other.params)
    return keys


class DeclaredWire:
    """The `wire` of a strategy or trainer class (`BaseStrategy.wire`, `BaseTrainer.wire`): the
    `fedskew.wire.Wire` of the cards that name the class (`MethodSpec.wire`, found by the class's
    dotted path, so that neither side imports the other), else its nearest registered base class's,
    else `fedskew.wire.BASE`. The one declaration both sides of a method read."""

    def __get__(self, obj: Any, cls: type) -> Wire:
        return wire_of(cls)


@functools.cache
def wire_of(cls: type) -> Wire:
    for c in cls.__mro__:
        path = f"{c.__module__}:{c.__qualname__}"
        wires = {id(m.wire): m.wire for m in METHODS.values() if path in (m.strategy, m.trainer)}
        if len(wires) > 1:
            raise TypeError(f"{path} serves methods that declare different wires")
        if wires:
            return wires.popitem()[1]
    return BASE


def get_method(name: str) -> MethodSpec:
    """The registered method `name`; raises KeyError listing the known ones."""
    try:
        return METHODS[name]
    except KeyError:
        raise KeyError(f"unknown method {name!r}: known are {', '.join(sorted(METHODS))}") from None
