"""Logging and debug dumps: the graph before and after the pass and decisions.json.

Dumps go to overlap_pass.config.debug_dir (OVERLAP_PASS_DEBUG_DIR) and, under
TORCH_COMPILE_DEBUG=1, into Inductor's debug folder of the graph; tlparse gets the same content as
trace_structured artifacts. Logging: TORCH_LOGS=+overlap_pass.
"""

import json
import logging
import os
import re

import torch
from torch._logging import trace_structured
from torch.fx import Graph

from .. import config

log = logging.getLogger("overlap_pass")

DECISIONS_FILE = "decisions.json"
BEFORE_FILE = "before.txt"
AFTER_FILE = "after.txt"


def graph_text(graph: Graph) -> str:
    """The graph as readable Python with shapes, strides and devices."""
    module = graph.owning_module
    if module is None:
        return str(graph)
    return module.print_readable(
        print_output=False, include_stride=True, include_device=True, colored=False
    )


def graph_name() -> str:
    """The name AOTAutograd gives the graph being compiled (forward, backward or inference)."""
    try:
        from torch._functorch._aot_autograd.logging_utils import get_aot_graph_name

        return get_aot_graph_name()
    except Exception:
        return "graph"


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _inductor_debug_dir() -> str | None:
    """Inductor's debug folder for this graph under TORCH_COMPILE_DEBUG=1, else None."""
    if not torch._inductor.config.trace.enabled:
        return None
    try:
        from torch._inductor.virtualized import V

        return V.debug.filename("overlap_pass")
    except Exception:
        return None


def dump_dirs() -> list[str]:
    """Folders this graph's dump goes to (none when dumping is off)."""
    dirs = []
    if config.debug_dir:
        dirs.append(os.path.join(config.debug_dir, f"rank{rank()}", _unique(graph_name())))
    inductor_dir = _inductor_debug_dir()
    if inductor_dir:
        dirs.append(inductor_dir)
    return dirs


_seen_names: dict[str, int] = {}


def _unique(name: str) -> str:
    """Graph names repeat across recompiles of one process; number the repeats."""
    count = _seen_names.get(name, 0)
    _seen_names[name] = count + 1
    return name if count == 0 else f"{name}.{count}"


def dumping() -> bool:
    return bool(config.debug_dir) or torch._inductor.config.trace.enabled


def write_dump(before: str, after: str, record: dict) -> list[str]:
    """Writes the dump files; returns the folders written."""
    dirs = dump_dirs()
    for folder in dirs:
        os.makedirs(folder, exist_ok=True)
        for name, text in ((BEFORE_FILE, before), (AFTER_FILE, after)):
            with open(os.path.join(folder, name), "w") as f:
                f.write(text)
        with open(os.path.join(folder, DECISIONS_FILE), "w") as f:
            f.write(decisions_json(record))
    return dirs


def decisions_json(record: dict) -> str:
    """Indented JSON with short lists (shapes, ranks) kept on one line."""
    text = json.dumps(record, indent=2)
    return re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + re.sub(r"\s*\n\s*", " ", m[1]) + "]", text) + "\n"


def trace_artifacts(before: str, after: str, record: dict) -> None:
    """The same content for tlparse (TORCH_TRACE)."""
    for name, encoding, payload in (
        ("overlap_pass_before", "string", lambda: before),
        ("overlap_pass_after", "string", lambda: after),
        ("overlap_pass_decisions", "json", lambda: json.dumps(record)),
    ):
        trace_structured(
            "artifact",
            metadata_fn=lambda name=name, encoding=encoding: {"name": name, "encoding": encoding},
            payload_fn=payload,
        )

