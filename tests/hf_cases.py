"""Hugging Face transformers' Llama and OLMo 2 with their own tensor-parallel plans (``tp_plan``:
plain TP, no sequence parallel), run on each rank of a RankPool: a small random config, saved by
rank 0 and loaded on every rank with ``DistributedConfig(tp_size=W)`` as its users load a
checkpoint. OLMo 2 normalizes Q and K over all heads, so its plan gathers the Q, K and V
projections' outputs (``colwise_gather_output``) after the split all-reduce's gather."""

import glob
import json
import os
import tempfile

import torch
import torch.distributed as dist

from overlap_pass import config
from overlap_pass.regions import split_cost

TOL = dict(atol=2e-5, rtol=2e-5)
SMALL = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, attn_implementation="sdpa",
)  # fmt: skip
FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "olmo2": ("Olmo2Config", "Olmo2ForCausalLM")}


def _classes(family: str):
    import transformers

    config_name, model_name = FAMILIES[family]
    return getattr(transformers, config_name), getattr(transformers, model_name)


def _load(folder: str, family: str):
    from transformers.distributed import DistributedConfig

    model = _classes(family)[1].from_pretrained(
        folder, distributed_config=DistributedConfig(tp_size=dist.get_world_size()), dtype=torch.float32
    )
    return model.train()


def _grads(model) -> dict:
    """Each parameter's local gradient by name (a DTensor's shard)."""
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
        grads[name.removeprefix("_orig_mod.")] = grad
    return grads


def forward_backward(folder: str, batch: int, seq: int, family: str = "llama") -> dict:
    """Two training steps of the compiled ``family`` model (a key of FAMILIES; backend="overlap")
    against the same model eager: loss, logits and every gradient at fp32 tolerance. Returns the
    pass's decisions, per graph: {"decisions": [{"graph", "kind", "rewritten", "reason"}],
    "graphs": {graph: its rewritten code}} (every rank must build the same collectives)."""
    torch._dynamo.reset()  # static shapes: no recompile as dynamic after another test's shapes
    eager, compiled = _saved_and_loaded(folder, family)
    compiled_fn = torch.compile(compiled, backend="overlap")
    dump = tempfile.mkdtemp(prefix="overlap-hf-")
    # the test model is small enough that a collective's latency would outweigh its bytes and the
    # cost model would keep the forward's all-reduces: counted as nothing, as at real sizes
    with config.patch(debug_dir=dump), split_cost.sizes_ignored():
        for step in range(2):
            ids = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(step))
            out_c, out_e = compiled_fn(input_ids=ids, labels=ids), eager(input_ids=ids, labels=ids)
            torch.testing.assert_close(out_c.logits, out_e.logits, **TOL)
            torch.testing.assert_close(out_c.loss, out_e.loss, **TOL)
            out_c.loss.backward()
            out_e.loss.backward()
            grads_c, grads_e = _grads(compiled), _grads(eager)
            assert grads_c.keys() == grads_e.keys()
            for name, grad in grads_e.items():
                torch.testing.assert_close(grads_c[name], grad, **TOL, msg=name)
            compiled.zero_grad(set_to_none=True)
            eager.zero_grad(set_to_none=True)
    candidates, graphs = _dumped(dump)
    decisions = [
        {"graph": "forward" if "forward" in graph else "backward", **_decision(c)} for graph, c in candidates
    ]
    return {"decisions": decisions, "graphs": graphs}


def _saved_and_loaded(folder: str, family: str) -> tuple:
    """The small random ``family`` model, saved by rank 0, loaded twice on every rank (eager and
    to compile)."""
    if dist.get_rank() == 0:
        config_class, model_class = _classes(family)
        torch.manual_seed(0)
        model_class(config_class(**SMALL)).save_pretrained(folder)
    dist.barrier()
    return _load(folder, family), _load(folder, family)


def _dumped(dump: str) -> tuple[list[tuple[str, dict]], dict]:
    """([(graph name, candidate record)] of every graph the pass dumped under ``dump``, {graph
    name: its rewritten code})."""
    candidates, graphs = [], {}
    for path in sorted(glob.glob(os.path.join(dump, "*", "*", "decisions.json"))):
        with open(path) as f:
            record = json.load(f)
        candidates += [(record["graph"], c) for c in record["candidates"]]
        with open(os.path.join(os.path.dirname(path), "after.txt")) as f:
            graphs[record["graph"]] = f.read()
    return candidates, graphs


def _decision(candidate: dict) -> dict:
    return {key: candidate[key] for key in ("kind", "rewritten", "reason")}


def prefill_at_lengths(folder: str, batch: int, lengths: list[int]) -> dict:
    """The compiled Llama (backend="overlap", eval, no grad) called once at each of
    ``lengths`` tokens a sequence, as a server prefills prompts of any length, against eager:
    logits at fp32 tolerance. After the second length torch.compile runs a graph with a
    symbolic length. Returns the decisions (forward_backward's form, with each split's
    padding), the graphs, and the overlap op calls each prefill ran."""
    from tests.cpu.dynamic_cases import count_overlap_ops

    torch._dynamo.reset()
    eager, compiled = (model.eval() for model in _saved_and_loaded(folder, "llama"))
    compiled_fn = torch.compile(compiled, backend="overlap")
    dump, calls = tempfile.mkdtemp(prefix="overlap-hf-"), []
    with config.patch(debug_dir=dump), split_cost.sizes_ignored(), torch.no_grad():
        for seq in lengths:
            ids = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seq))
            calls.append(count_overlap_ops(lambda: setattr(compiled_fn, "out", compiled_fn(input_ids=ids))))
            torch.testing.assert_close(compiled_fn.out.logits, eager(input_ids=ids).logits, **TOL)
    candidates, graphs = _dumped(dump)
    decisions = [
        {"graph": graph, **_decision(c), "padded": (c.get("split") or {}).get("padded")} for graph, c in candidates
    ]
    return {"decisions": decisions, "graphs": graphs, "calls": calls}
