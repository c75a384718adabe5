"""bench/user_level.py --sst2: the rule that rebuilds SST-2's review sentences from its phrases, and the
group-privacy figure of the example-level run (the bench itself runs for minutes and is not run here)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import script_module

BENCH = Path(__file__).resolve().parents[1] / "bench" / "user_level.py"


@pytest.fixture(scope="module")
def bench():
    with script_module(BENCH, "bench_user_level") as module:
        yield module


def test_each_phrase_goes_to_the_longest_sentence_containing_it(bench):
    phrases = ["good", "a good film", "not a good film at all", "bad", "a bad day", "film", "at all",
               "a really bad day", "really", "a good"]
    got = bench.assign_sentences(phrases)
    # sentences: phrases inside no other phrase ("not a good film at all", "a really bad day"), ids in the order
    # they are met (longest first); "a bad day" is no sub-phrase of "a really bad day" (tokens must be contiguous)
    by_phrase = dict(zip(phrases, got))
    assert len(set(got)) == 3
    assert {by_phrase[p] for p in ("good", "a good film", "not a good film at all", "film", "at all", "a good")} \
        == {by_phrase["not a good film at all"]}
    assert by_phrase["really"] == by_phrase["a really bad day"]
    assert by_phrase["a bad day"] != by_phrase["a really bad day"] and by_phrase["bad"] in (
        by_phrase["a bad day"], by_phrase["a really bad day"])
    # a phrase in two sentences of one length goes to the one first in the file; in two of different lengths, to
    # the longer one
    assert bench.assign_sentences(["x y", "x y z w", "q x y r"]) == [0, 0, 1]
    assert bench.assign_sentences(["x y", "q x y r", "x y z w v"]) == [0, 1, 0]


def test_group_privacy_of_the_most_active_unit(bench):
    g = bench._group_privacy(2.0, 1e-5, 3)
    assert g["epsilon"] == pytest.approx(6.0)
    assert g["delta"] == pytest.approx(3 * math.exp(4.0) * 1e-5) and g["meaningful"]
    big = bench._group_privacy(8.0, 1e-5, 45)
    assert big["epsilon"] == pytest.approx(360.0) and not big["meaningful"] and big["delta"] is None
    assert big["delta_log10"] == pytest.approx(math.log10(45) + 44 * 8 / math.log(10) - 5)


def test_chat_splits_share_no_person(bench):
    """--chat: a conversation goes whole to the split owning one of its two people (or to the first split with
    room); one whose people are owned by two splits, or by a full one, or whose opener never answers, is skipped."""
    def conv(a, b, n):
        return [{"context": "c", "response": "r", "sender": (a, b)[i % 2]} for i in range(n)]

    convs = {"c0": conv("ann", "bob", 4), "c1": conv("bob", "cat", 3), "c2": conv("dan", "eve", 4),
             "c3": conv("ann", "eve", 2), "c4": [{"context": "c", "response": "r", "sender": "fay"}],
             "c5": conv("gus", "hal", 6), "c6": conv("ivy", "jon", 6)}
    done = 0
    for seed in range(20):
        try:  # some orders leave too few conversations for these sizes: the bench stops, it never shrinks a split
            out = bench.split_by_person(convs, {"public": 3, "reported": 3, "private": 4}, seed=seed)
        except SystemExit as stop:
            assert "too few conversations" in str(stop)
            continue
        done += 1
        people = {name: {r["sender"] for r in rows} for name, rows in out.items()}
        assert [len(out[n]) for n in ("public", "reported", "private")] == [3, 3, 4]
        assert not people["public"] & people["reported"] and not people["public"] & people["private"]
        assert not people["reported"] & people["private"] and "fay" not in set().union(*people.values())
    assert done >= 5
    with pytest.raises(SystemExit, match="too few conversations"):
        bench.split_by_person(convs, {"public": 3, "private": 100})
