"""check_finite: the sum as a first test, the element-wise test as the judge."""

import pytest
import torch

from peer.train.outer import check_finite
from protocol.errors import BadPayload

BAD = float("nan"), float("inf"), -float("inf")


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_one_non_finite_element_is_found_and_its_tensor_named(bad, dtype):
    tensors = [torch.randn(7, 5).to(dtype), torch.randn(1000).to(dtype), torch.randn(3).to(dtype)]
    tensors[1][417] = bad
    with pytest.raises(BadPayload, match=r"round x: tensor 1 of shape \(1000,\) holds NaN or inf"):
        check_finite(tensors, "round x")


def test_plus_and_minus_inf_in_one_tensor_are_found():
    t = torch.zeros(10)
    t[2], t[8] = float("inf"), -float("inf")
    with pytest.raises(BadPayload, match="tensor 0"):
        check_finite([t], "x")


@pytest.mark.parametrize(
    "values, dtype", [([3e38, 3e38, 1.0], torch.float32), ([6e4, 6e4], torch.float16), ([-3e38, -3e38], torch.float32)]
)
def test_finite_values_whose_sum_overflows_are_accepted(values, dtype):
    t = torch.tensor(values, dtype=dtype)
    assert not torch.isfinite(t.sum())  # the case the element-wise test decides
    check_finite([t, torch.ones(3)], "x")


def test_finite_and_empty_tensors_pass():
    check_finite([torch.randn(64, 64), torch.empty(0), torch.tensor(1.5)], "x")
    check_finite([], "x")


def test_finite_tensors_whose_sums_overflow_fp32_together_or_alone_are_accepted():
    """The sums of all tensors are added in fp32 for one test: an overflow there (two sums of 3e38,
    or a float64 sum beyond fp32's range) is decided tensor by tensor, element-wise."""
    check_finite([torch.tensor([3e38]), torch.tensor([3e38]), torch.ones(2)], "x")
    check_finite([torch.tensor([1e300], dtype=torch.float64), torch.ones(2)], "x")
    with pytest.raises(BadPayload, match="tensor 2"):
        check_finite([torch.tensor([3e38]), torch.tensor([3e38]), torch.tensor([float("nan")])], "x")
