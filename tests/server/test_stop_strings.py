"""Stop strings in O(new text) per step: the same first match as scanning every string."""

from __future__ import annotations

import random

from expresslane.engine.detokenizer import StopStrings


def scan_every_string(stop: list[str], text: str, new_from: int) -> tuple[int, str] | None:
    """The reference: every stop string searched from where a match of it would end in the new text."""
    best = None
    for s in stop:
        i = text.find(s, max(0, new_from - len(s) + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best


def test_same_first_match_as_a_scan_of_every_string():
    rng = random.Random(0)
    for _ in range(3000):
        stop = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 6))]
        text = "".join(rng.choice("abcd") for _ in range(rng.randint(0, 12)))
        new_from = rng.randint(0, len(text))
        assert StopStrings(stop).find(text, new_from) == scan_every_string(stop, text, new_from), (stop, text)


def test_ties_go_to_the_earlier_string_in_the_list():
    assert StopStrings(["ab", "abc"]).find("xabc", 0) == (1, "ab")
    assert StopStrings(["abc", "ab"]).find("xabc", 0) == (1, "abc")
    assert StopStrings(["bc", "ab"]).find("abc", 0) == (0, "ab")  # earliest start first, whatever the order


def test_cost_does_not_grow_with_the_number_of_strings():
    stop = [f"stop-{i}-x" for i in range(300_000)]
    s = StopStrings(stop)
    calls = 0
    real = s.rank.get

    def counting(key):
        nonlocal calls
        calls += 1
        return real(key)

    s.rank = type("R", (), {"get": staticmethod(counting)})()
    assert s.find("some text then stop-299999-x", 20) == (15, "stop-299999-x")
    assert calls <= (len("some text then stop-299999-x") - 20) * len(s.lengths)  # new chars × lengths
