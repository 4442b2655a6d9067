"""``TokenIds``, the view a ``Row`` holds of the committed output: it behaves as the tuple of
its ids (the oracle: Python's own tuple, under every index and slice), stays fixed while the
engine's list grows, and extends without copying the list."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.contracts.decode import TokenIds, with_tokens

ids = st.lists(st.integers(0, 50), max_size=12)


@settings(max_examples=300, deadline=None)
@given(ids, ids, ids, st.integers(-20, 20), st.integers(-20, 20), st.sampled_from([1, 2, -1, -3]))
def test_a_view_is_its_tuple(base: list[int], later: list[int], tail: list[int], start: int,
                             stop: int, step: int) -> None:
    live = list(base)
    view = TokenIds(live).extended(tail)
    live.extend(later)  # the engine's list grows after the row was made
    want = (*base, *tail)
    assert len(view) == len(want) and tuple(view) == want and view == want == view
    assert view[start:stop:step] == list(want[start:stop:step])
    assert view[start:] == list(want[start:]) and view[:stop] == list(want[:stop])
    for i in range(-len(want) - 2, len(want) + 2):
        if -len(want) <= i < len(want):
            assert view[i] == want[i]
        else:
            with pytest.raises(IndexError):
                view[i]
    assert with_tokens(view, [7]) == (*want, 7) and with_tokens(tuple(want), [7]) == (*want, 7)
    assert view != (*want, 99) and view != "abc"
