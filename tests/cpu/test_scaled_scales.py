"""The rowwise scales handed to torch._scaled_mm: cuBLAS refuses a scale vector that does not
start on 16 bytes (seen on an H100: a rank's chunk of a gathered scale, 103 rows a rank), so
such a view is copied; an aligned, standard one is passed as it is."""

import pytest
import torch

from overlap_pass.ops import scaled_ops


@pytest.mark.parametrize("start", [1, 2, 3, 103])
def test_a_scale_view_off_16_bytes_is_copied_to_an_aligned_one(start):
    gathered = torch.rand(2 * 103 + 8, 1) + 0.5
    chunk = gathered[start : start + 103]
    assert chunk.data_ptr() % 16 != 0
    fixed = scaled_ops._standard_strides(chunk)
    assert fixed.data_ptr() % 16 == 0 and fixed.stride() == (1, 1)
    assert torch.equal(fixed, chunk)


def test_an_aligned_standard_scale_is_passed_as_it_is():
    gathered = torch.rand(2 * 104, 1)
    chunk = gathered[104:]  # 416 bytes in
    assert scaled_ops._standard_strides(chunk) is chunk
