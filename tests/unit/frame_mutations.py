"""A hypothesis strategy for the frame-parser fuzz tests (test_wire_*.py): good frames with one
byte flipped, cut short or extended, and plain noise."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st


def frame_mutations(good: Sequence[bytes]) -> st.SearchStrategy[bytes]:
    seeds = st.sampled_from(list(good))
    flip = st.tuples(seeds, st.integers(0, 10_000), st.integers(1, 255)).map(
        lambda t: t[0][: t[1] % len(t[0])] + bytes([t[0][t[1] % len(t[0])] ^ t[2]]) + t[0][t[1] % len(t[0]) + 1 :]
    )
    cut = st.tuples(seeds, st.integers(0, 10_000)).map(lambda t: t[0][: t[1] % (len(t[0]) + 1)])
    extend = st.tuples(seeds, st.binary(max_size=64)).map(lambda t: t[0] + t[1])
    return st.one_of(st.binary(max_size=256), flip, cut, extend)
