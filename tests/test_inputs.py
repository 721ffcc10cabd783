"""The batch's finite check (mscale.hook.checks.inputs.finite): exact for every dtype it takes the
max-and-min path for, large finite values included."""

from __future__ import annotations

import pytest
import torch

from mscale.hook.checks.inputs import finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_one_nonfinite_element_anywhere_is_found(dtype: torch.dtype, bad: float) -> None:
    for where in (0, 777, 8 * 3 * 16 * 16 - 1):
        t = torch.rand(8, 3, 16, 16).to(dtype)
        assert bool(finite(t))
        t.view(-1)[where] = bad
        assert not bool(finite(t)), (dtype, bad, where)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_largest_finite_values_are_finite_even_where_their_sum_overflows_the_dtype(dtype: torch.dtype) -> None:
    big = torch.finfo(dtype).max
    t = torch.full((4096,), big, dtype=dtype)
    assert not torch.isfinite(t.sum(dtype=torch.float32 if dtype != torch.float16 else torch.float16))
    assert bool(finite(t))
    t[-1] = -big
    assert bool(finite(t))


def test_an_empty_input_is_finite() -> None:
    assert bool(finite(torch.empty(0, 3)))


def test_a_strided_view_is_checked_over_its_own_elements_only() -> None:
    base = torch.rand(6, 6)
    base[:, 1] = float("nan")
    assert bool(finite(base[:, ::2]))
    assert not bool(finite(base[:, 1::2]))
