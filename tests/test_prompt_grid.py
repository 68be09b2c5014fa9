"""The ServerApp's Grid wrapper: replies collected over several pulls, pauses of 0.01-0.1 s between
pulls (Flower's deployment Grid sleeps 3 s), partial results at the timeout."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fedskew.server_app import app as server_app
from fedskew.server_app.app import PromptGrid


class PulledGrid:
    """Pushes return ids m0, m1 ...; the reply to message k arrives at the (k + 1)-th pull."""

    def __init__(self) -> None:
        self.pulls = 0

    def push_messages(self, messages):
        return [f"m{k}" for k, _ in enumerate(messages)]

    def pull_messages(self, ids):
        self.pulls += 1
        due = [i for i in sorted(ids) if int(i[1:]) < self.pulls]
        return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=i)) for i in due]

    def get_node_ids(self):
        return [7]


@pytest.fixture
def pauses(monkeypatch) -> list[float]:
    slept: list[float] = []
    monkeypatch.setattr(server_app.time, "sleep", slept.append)
    return slept


def test_replies_are_collected_over_short_pauses_and_the_rest_is_delegated(pauses) -> None:
    grid = PulledGrid()
    replies = PromptGrid(grid).send_and_receive(["a", "b", "c"], timeout=60)
    assert [r.metadata.reply_to_message_id for r in replies] == ["m0", "m1", "m2"]
    assert grid.pulls == 3 and len(pauses) == 2
    assert all(0.01 <= p <= 0.1 for p in pauses)
    assert PromptGrid(grid).get_node_ids() == [7]


def test_the_timeout_returns_what_arrived(monkeypatch, pauses) -> None:
    clock = iter(range(100))  # each look at the clock is a second later
    monkeypatch.setattr(server_app.time, "monotonic", lambda: float(next(clock)))
    replies = PromptGrid(PulledGrid()).send_and_receive(["a", "b", "c", "d", "e"], timeout=5)
    assert 0 < len(replies) < 5
