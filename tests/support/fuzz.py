"""Hypothesis strategies the fuzz tests share."""

from __future__ import annotations

from hypothesis import strategies as st


def json_values(
    *,
    int_bound: int | None = None,
    nan: bool = False,
    infinity: bool = False,
    max_text: int = 40,
    max_key: int = 8,
    max_leaves: int = 12,
) -> st.SearchStrategy:
    """Anything JSON can carry, nested: integers within +-int_bound (None: unbounded), floats
    with NaN and infinities only when asked (Python's json writes them, strict parsers refuse them)."""
    ints = st.integers() if int_bound is None else st.integers(min_value=-int_bound, max_value=int_bound)
    scalars = (
        st.none()
        | st.booleans()
        | ints
        | st.floats(allow_nan=nan, allow_infinity=infinity)
        | st.text(max_size=max_text)
    )
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=max_key), inner, max_size=4),
        max_leaves=max_leaves,
    )
