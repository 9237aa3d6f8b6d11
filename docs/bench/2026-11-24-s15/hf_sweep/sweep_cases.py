"""Mirror of /work/main/tests/hf_cases.py (Llama case) for other HF models."""
import glob, json, os, tempfile, unittest.mock
import torch
import torch.distributed as dist
from overlap_pass import all_reduce_split, config

TOL = dict(atol=2e-5, rtol=2e-5)

MODELS = {
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "cohere": ("CohereConfig", "CohereForCausalLM"),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM"),
    "glm4": ("Glm4Config", "Glm4ForCausalLM"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}


def _config(name):
    import transformers as T
    cls = getattr(T, MODELS[name][0])
    defaults = cls().to_dict()
    kw = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="sdpa", pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    if "tie_word_embeddings" in defaults:
        kw["tie_word_embeddings"] = False
    if "head_dim" in defaults or name in ("qwen3_moe", "mixtral"):
        kw["head_dim"] = 16
    if "query_pre_attn_scalar" in defaults:
        kw["query_pre_attn_scalar"] = 16
    if name == "gemma2":  # Gemma2ForCausalLM refuses sdpa in transformers 5.23
        kw["attn_implementation"] = "eager"
    if name == "qwen3_moe":
        kw.update(moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2)
    if name == "mixtral":
        kw.update(num_local_experts=4, num_experts_per_tok=2)
    kw.update(json.loads(os.environ.get("SWEEP_EXTRA_CFG", "{}")))
    cfg = cls(**kw)
    return cfg


def _model_cls(name):
    import transformers as T
    return getattr(T, MODELS[name][1])


def _load(name, folder):
    from transformers.distributed import DistributedConfig
    model = _model_cls(name).from_pretrained(
        folder, distributed_config=DistributedConfig(tp_size=dist.get_world_size()), dtype=torch.float32
    )
    return model.train()


def _grads(model):
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        grads[n.removeprefix("_orig_mod.")] = g
    return grads


def _maxdiff(a, b):
    a = a.to_local() if hasattr(a, "to_local") else a
    b = b.to_local() if hasattr(b, "to_local") else b
    if a is None or b is None:
        return f"None? c={a is None} e={b is None}"
    return (a.detach().float() - b.detach().float()).abs().max().item()


def forward_backward(name, folder, batch, seq, backend="overlap"):
    torch._dynamo.reset()
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        _model_cls(name)(_config(name)).save_pretrained(folder)
    dist.barrier()
    eager, compiled = _load(name, folder), _load(name, folder)
    compiled_fn = torch.compile(compiled, backend=backend)
    dump = tempfile.mkdtemp(prefix=f"overlap-hf-{name}-", dir=tempfile.gettempdir())
    mismatches = []
    with config.patch(debug_dir=dump), unittest.mock.patch.object(all_reduce_split, "LATENCY_BYTES", 0):
        for step in range(2):
            ids = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(step))
            out_c, out_e = compiled_fn(input_ids=ids, labels=ids), eager(input_ids=ids, labels=ids)
            for tname, c, e in (("logits", out_c.logits, out_e.logits), ("loss", out_c.loss, out_e.loss)):
                try:
                    torch.testing.assert_close(c, e, **TOL)
                except AssertionError:
                    mismatches.append((step, tname, _maxdiff(c, e)))
            out_c.loss.backward()
            out_e.loss.backward()
            grads_c, grads_e = _grads(compiled), _grads(eager)
            assert grads_c.keys() == grads_e.keys()
            for n, g in grads_e.items():
                try:
                    torch.testing.assert_close(grads_c[n], g, **TOL, msg=n)
                except AssertionError:
                    mismatches.append((step, "grad:" + n, _maxdiff(grads_c[n], g)))
            compiled.zero_grad(set_to_none=True)
            eager.zero_grad(set_to_none=True)
    decisions = []
    for path in sorted(glob.glob(os.path.join(dump, "*", "*", "decisions.json"))):
        with open(path) as f:
            record = json.load(f)
        kind = "forward" if "forward" in record["graph"] else "backward"
        decisions += [
            {"graph": kind, "kind": c["kind"], "rewritten": c["rewritten"], "reason": c["reason"]}
            for c in record["candidates"]
        ]
    return {"mismatches": mismatches, "decisions": decisions, "dump": dump}
