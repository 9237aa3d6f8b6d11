"""overlap: overlap tensor-parallel collectives with their matmuls under torch.compile.

    torch.compile(model, backend="overlap")          # this pass, always
    overlap_pass.config.enabled = True               # or inside the default torch.compile
"""

from . import config, ops
from .backend import overlap_backend
from .graph_pass import OverlapNotApplied, OverlapPass, install
from .ops import registry  # noqa: F401  (registers the ops)

__all__ = ["OverlapNotApplied", "OverlapPass", "config", "ops", "overlap_backend"]

# Registration, like the ops: the default Inductor compile gets a hook that stays inert until
# config.enabled is set.
install()
