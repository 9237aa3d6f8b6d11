"""The environment the GPU tools run in, set before torch and overlap_pass are imported (both
read it then); a variable the caller set wins.

- NVLink multicast (NVLS) and symmetric memory's multicast off: it can take shared GPUs down.
- Waits that give up after seconds, not the default ten minutes: a lost peer fails a run fast.
- The chosen variants from a call signature's first call (users' calls run NCCL + cuBLAS at a
  signature's first ones, config.fused_from_call): the fused path is what the tools check and
  time from the first call.
"""

import os

DEFAULTS = (
    ("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1"),
    ("OVERLAP_PASS_SPIN_LIMIT", "20000000"),
    ("OVERLAP_PASS_FUSED_FROM_CALL", "1"),
)  # fmt: skip


def set_defaults(fused_from_first_call: bool = True) -> None:
    """The defaults above; without ``fused_from_first_call``, the first calls as users get them."""
    for var, value in DEFAULTS:
        if fused_from_first_call or var != "OVERLAP_PASS_FUSED_FROM_CALL":
            os.environ.setdefault(var, value)
