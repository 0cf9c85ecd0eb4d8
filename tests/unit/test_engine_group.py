"""Grouped sums (memrec.engine.group) against the sort they replace, np.unique(axis=0)."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from memrec.engine.group import group
from memrec.engine.group import group_sum

column = st.sampled_from([(-1, 8), (0, 1 << 22), (1000, 1 << 40), (-5, 5)])


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 400), st.lists(column, min_size=1, max_size=4), st.integers(0, 2**32 - 1))
def test_groups_are_those_of_np_unique_in_the_same_order(n, spans, seed):
    # GIVEN integer columns of small and huge ranges (dense tables and sorts both used)
    rng = np.random.default_rng(seed)
    cols = [rng.integers(lo, hi, n) if rng.random() < 0.5 else rng.choice(rng.integers(lo, hi, 3), n)
            for lo, hi in spans]
    values = rng.integers(-(1 << 40), 1 << 40, n)
    # WHEN they are grouped
    inverse, keys = group(cols)
    # THEN the groups, their order and the rows' groups are np.unique(axis=0)'s; sums are exact
    uniq, want = np.unique(np.stack(cols, axis=1), axis=0, return_inverse=True)
    assert np.array_equal(np.stack(keys, axis=1), uniq)
    assert np.array_equal(inverse, want.reshape(-1))
    sums = group_sum(inverse, len(uniq), values)
    assert sums.tolist() == [int(values[want.reshape(-1) == g].sum()) for g in range(len(uniq))]
