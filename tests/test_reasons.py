"""What `failures.jsonl` keeps of a lost reply: the exception's type and message (`fedskew.reasons`),
on error texts that Flower and Ray really wrote (tests/fixtures/flower_error_reasons.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedskew.reasons import LIMIT, exception_of, short_reason

REAL = json.loads((Path(__file__).parent / "fixtures" / "flower_error_reasons.json").read_text())


def test_a_ray_simulation_error_gives_the_clientapps_own_exception() -> None:
    text = REAL["ray-direct-cause"]
    assert len(text) > LIMIT and "BadZipFile" not in text[:LIMIT]  # what the first 500 characters miss
    path = "/data/.fedskew-cache/fashion-mnist-p3of10-0123456789abcdef0123-0123456789abcdef.npz"
    assert short_reason(text) == f"zipfile.BadZipFile: File is not a zip file: {path}"


def test_an_exception_raised_while_handling_another_gives_the_last_one_in_one_line() -> None:
    exc_type, message = exception_of(REAL["ray-during-handling"])
    assert (exc_type, message) == ("ValueError", "map.json: participations='x' is not an integer\nsecond line")
    assert short_reason(REAL["ray-during-handling"]) == (
        "ValueError: map.json: participations='x' is not an integer / second line"
    )


def test_a_dead_actor_keeps_rays_type_and_message_bounded() -> None:
    reason = short_reason(REAL["ray-actor-died"])
    assert reason.startswith("ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.")
    assert len(reason) == LIMIT and reason.endswith("...") and "\n" not in reason


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # deployment: flwr-clientapp writes str(type(ex)) + ":<'" + str(ex) + "'>"
        ("<class 'zipfile.BadZipFile'>:<'File is not a zip file'>", "zipfile.BadZipFile: File is not a zip file"),
        ("<class 'KeyError'>:<''hpm''>", "KeyError: 'hpm'"),
        # the server's own reasons (screening, no reply) and the SuperLink's are kept as they are
        ("array 'w' of 'arrays' holds NaN or inf", "array 'w' of 'arrays' holds NaN or inf"),
        ("Error: Node Unavailable", "Error: Node Unavailable"),
        ("no reply within round-timeout=600 s", "no reply within round-timeout=600 s"),
        ("", ""),
    ],
)
def test_other_reasons(text: str, expected: str) -> None:
    assert short_reason(text) == expected


def test_a_plain_python_traceback() -> None:
    text = (
        "Traceback (most recent call last):\n"
        '  File "/opt/app/client.py", line 3, in <module>\n'
        "    int('x')\n"
        "ValueError: invalid literal for int() with base 10: 'x'\n"
    )
    assert short_reason(text) == "ValueError: invalid literal for int() with base 10: 'x'"


def test_every_reason_is_one_bounded_line() -> None:
    for text in [*REAL.values(), "x" * 10_000, "a\nb\n" * 1000, "\x1b[31mred\x1b[0m"]:
        reason = short_reason(text, limit=120)
        assert len(reason) <= 120 and "\n" not in reason and "\x1b" not in reason
