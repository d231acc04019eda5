"""The shared check of int arguments (``scv_jax.arguments``)."""

from __future__ import annotations

import numpy as np
import pytest

from scv_jax.arguments import is_int, require_int


@pytest.mark.parametrize("value, ok", [(3, True), (np.int32(3), True), (np.int64(0), False), (True, False),
                                       (3.0, False), ("3", False), (None, False), (-1, False), (1, True)])
def test_is_int_takes_ints_at_least_the_minimum_and_nothing_else(value, ok):
    assert is_int(value, 1) is ok


def test_require_int_returns_a_python_int_or_raises_naming_the_argument():
    value = require_int("op", "size", np.int64(4), minimum=0)
    assert value == 4 and type(value) is int
    with pytest.raises(ValueError, match=r"^op: size must be an int >= 2, got 1$"):
        require_int("op", "size", 1, minimum=2)
    with pytest.raises(ValueError, match=r"^op: k must be a Python int >= 0 \(static\), got 1.5$"):
        require_int("op", "k", 1.5, minimum=0, static=True)
