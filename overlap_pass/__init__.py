"""overlap: overlap tensor-parallel collectives with their matmuls under torch.compile.

    torch.compile(model, backend="overlap")          # this pass, always
    overlap_pass.config.enabled = True               # or inside the default torch.compile
"""

from . import config, ops
from .backend import overlap_backend
from .ops import registry  # noqa: F401  (registers the ops)
from .pipeline.install import install
from .pipeline.passes import OverlapPass
from .pipeline.report import OverlapNotApplied

__all__ = ["OverlapNotApplied", "OverlapPass", "config", "ops", "overlap_backend"]

# Registration, like the ops: the default Inductor compile gets a hook that stays inert until
# config.enabled is set.
install()
