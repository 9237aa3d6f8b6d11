"""Every knob of overlap, Inductor style.

Set a knob in code (``overlap_pass.config.enabled = True``), for a block
(``with overlap_pass.config.patch(enabled=True): ...``), or from the environment
(``OVERLAP_PASS_<NAME>``, read when overlap_pass is imported).
"""

import sys

from torch.utils._config_module import Config, install_config_module

# Apply the pass inside the default ``torch.compile(model)`` (backend="inductor") too.
# backend="overlap" applies it whatever this says. Needs ``import overlap_pass`` first.
enabled: bool = Config(default=False, env_name_default="OVERLAP_PASS_ENABLED")

# Rewrite all_gather -> matmul pairs into overlap::all_gather_matmul.
all_gather_matmul: bool = Config(default=True, env_name_default="OVERLAP_PASS_ALL_GATHER_MATMUL")

# Rewrite matmul -> reduce_scatter pairs into overlap::matmul_reduce_scatter.
matmul_reduce_scatter: bool = Config(
    default=True, env_name_default="OVERLAP_PASS_MATMUL_REDUCE_SCATTER"
)

# Which implementation the rewritten ops run: "auto" picks per device and shape (today the
# reference decomposition everywhere); "reference" forces the torch.distributed decomposition.
implementation: str = Config(default="auto", env_name_default="OVERLAP_PASS_IMPLEMENTATION")

# Folder for debug dumps: per compiled graph, the graph before and after the pass and
# decisions.json. Dumping turns the FX graph cache off for those graphs, so that every compile
# writes its dump. TORCH_COMPILE_DEBUG=1 also dumps, into Inductor's debug folder.
debug_dir: str | None = Config(default=None, env_name_default="OVERLAP_PASS_DEBUG_DIR")

IMPLEMENTATIONS = ("auto", "reference")

install_config_module(sys.modules[__name__])
