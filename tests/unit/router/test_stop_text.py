import itertools

from hypothesis import given
from hypothesis import strategies as st

from services.router.stop_text import StopTextFilter


def run(stops, pieces):
    f = StopTextFilter(stops)
    out = "".join(f.push(p) for p in pieces)
    return out + f.flush(), f.stopped


def test_text_is_cut_before_the_stop_string_even_across_deltas():
    assert run(["STOP"], ["hello S", "TO", "P and more"]) == ("hello ", True)
    assert run(["\n\n"], ["a\n", "\nb"]) == ("a", True)


def test_held_text_that_is_not_a_stop_comes_out():
    f = StopTextFilter(["STOP"])
    assert f.push("abc ST") == "abc "  # "ST" could start STOP
    assert f.push("ay") == "STay"
    assert run(["STOP"], ["end S"]) == ("end S", False)  # flushed at the end


def test_earliest_of_several_stops_wins_and_no_stops_passes_through():
    assert run(["xyz", "b"], ["aaxyzb"]) == ("aa", True)
    assert run([], ["any", "thing"]) == ("anything", False)


@given(
    st.text(alphabet="abcS", max_size=40),
    st.lists(st.integers(0, 40), max_size=6),
    st.text(alphabet="abS", min_size=1, max_size=3),
)
def test_equals_cutting_the_whole_text(text, cuts, stop):
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    i = text.find(stop)
    assert run([stop], pieces)[0] == (text[:i] if i >= 0 else text)
