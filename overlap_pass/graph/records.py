"""A decision record: one per candidate the pass considered (a collective next to matmuls, an
all-reduce the split considered, a plain all-gather that could ride in a fused op), whether it
was rewritten and why not. decisions.json lists them as ``candidates``; TORCH_LOGS=+overlap_pass
logs each.
"""

import dataclasses

from torch.fx import Node

from .nodes import describe_node


@dataclasses.dataclass
class Decision:
    kind: str  # "all_gather_matmul", "matmul_reduce_scatter", "all_reduce_split", ...
    collective: dict  # the collective, as describe_node gives it
    rewritten: bool = False
    reason: str | None = None  # why not, where not rewritten
    implementation: str | None = None  # what the rewritten op runs, as far as compile time knows
    op: str | None = None  # the node it became (or rides in)
    # what the match found (group, dim, nodes, ...), in the order decisions.json shows it
    facts: dict = dataclasses.field(default_factory=dict)
    # what later stages added (moves before the gather, passengers, tail matmuls, the split)
    notes: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, kind: str, collective: Node, **facts) -> "Decision":
        return cls(kind, describe_node(collective), facts=facts)

    @property
    def name(self) -> str:
        """The collective's node name."""
        return self.collective["name"]

    def accept(self, implementation: str | None) -> None:
        self.rewritten, self.reason, self.implementation = True, None, implementation

    def skip(self, reason: str) -> None:
        self.rewritten, self.reason, self.implementation, self.op = False, reason, None, None

    def as_json(self) -> dict:
        record = {"kind": self.kind, "collective": self.collective, **self.facts}
        record.update(rewritten=self.rewritten, reason=self.reason, implementation=self.implementation)
        if self.op is not None:
            record["op"] = self.op
        return {**record, **self.notes}
