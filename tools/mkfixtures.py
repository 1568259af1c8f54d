#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Build the tiny DeepSeek-V4 oracle fixtures under tests/fixtures/.

Each fixture is a small DeepseekV4ForCausalLM from Hugging Face transformers (>= 5.8) with every
parameter and buffer drawn at random from a fixed seed (transformers' own init leaves sinks, position
biases, hc bases/scales, the selection bias and tid2eid at zero or trivial values), saved with
save_pretrained, reloaded, and run in float32 with eager attention on the CPU.  For each prompt it stores
the logits of every prompt position and of DECODE greedy steps (each step fed the argmax of the previous
row), once for one-shot prefill and once per chunk size for chunked prefill through the model's cache.

Before writing anything the script asserts what makes the fixtures worth testing against:
  * the SwiGLU clamp fires (gate above the limit, up above and below it) in routed and shared experts;
  * the selection bias changes some scored-MoE choices; the indexer drops complete entries (top-k < count);
  * no selection is a near tie (indexer top-k, MoE top-k, greedy argmax), so a correct float32
    implementation must reproduce the same choices;
  * chunked prefill == one-shot prefill, and prefill + decode == one cache-free forward over the whole
    sequence (rows within float tolerance, greedy tokens identical);
  * two runs give bitwise identical logits; the reloaded model holds exactly the built tensors and computes
    the same logits within float tolerance.

Usage: python3 tools/mkfixtures.py [--out tests/fixtures]
"""

import argparse
import json
import math
import os
import sys

import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as dsv4

# Greedy decode steps stored after every prompt.
DECODE = 16
# Chunked vs one-shot and cached vs cache-free: max |diff| / max |logit| per row.
ROW_TOLERANCE = 2e-5
# Near-tie guards: a selection whose deciding gap is below these would be fragile.
MIN_LOGIT_GAP_REL = 1e-3      # (top1 - top2) / max |logit| of the row
MIN_ROUTER_GAP = 1e-4         # k-th vs (k+1)-th biased score, scores are O(1)
MIN_INDEX_GAP_REL = 1e-4      # k-th vs (k+1)-th index score / max |score| of the row

# The three models.  Between them: every layer type, hash and scored MoE, hc_mult 4, 2 and 3, YaRN and
# plain RoPE on the compressed branch, chunk sizes that do and do not align with the compress rates.
MODELS = [
    {
        "name": "tiny_a",
        "seed": 1001,
        "config": {
            "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "head_dim": 32, "q_lora_rank": 32,
            "o_groups": 2, "o_lora_rank": 16,
            "layer_types": ["sliding_attention", "compressed_sparse_attention",
                            "heavily_compressed_attention", "compressed_sparse_attention"],
            "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
            "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
            "sliding_window": 16, "index_n_heads": 16, "index_head_dim": 16, "index_topk": 8,
            "max_position_embeddings": 1048576,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
            "hc_mult": 4, "hc_sinkhorn_iters": 20,
            "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "partial_rotary_factor": 0.25,
            "rope_parameters": {
                "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "partial_rotary_factor": 0.25,
                             "factor": 16.0, "original_max_position_embeddings": 65536,
                             "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.0},
            },
        },
        "prompts": [{"length": 100, "seed": 11, "chunks": [7, 1]}, {"length": 45, "seed": 12, "chunks": [16]}],
    },
    {
        "name": "tiny_b",
        "seed": 2003,
        "config": {
            "vocab_size": 320, "hidden_size": 96, "num_hidden_layers": 3,
            "num_attention_heads": 4, "head_dim": 64, "q_lora_rank": 48,
            "o_groups": 4, "o_lora_rank": 16,
            "layer_types": ["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"],
            "mlp_layer_types": ["hash_moe", "moe", "moe"],
            "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            "sliding_window": 12, "index_n_heads": 16, "index_head_dim": 16, "index_topk": 6,
            "max_position_embeddings": 65536,
            "n_routed_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 24,
            "routed_scaling_factor": 2.5, "swiglu_limit": 7.0,
            "hc_mult": 2, "hc_sinkhorn_iters": 10,
            "rope_theta": 10000.0, "compress_rope_theta": 40000.0, "partial_rotary_factor": 0.25,
            "rope_parameters": {
                "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                "compress": {"rope_type": "default", "rope_theta": 40000.0, "partial_rotary_factor": 0.25},
            },
        },
        "prompts": [{"length": 90, "seed": 21, "chunks": [5]}, {"length": 30, "seed": 22, "chunks": [8]}],
    },
    {
        "name": "tiny_c",
        "seed": 3004,
        "config": {
            "vocab_size": 288, "hidden_size": 64, "num_hidden_layers": 5,
            "num_attention_heads": 8, "head_dim": 32, "q_lora_rank": 32,
            "o_groups": 4, "o_lora_rank": 8,
            "layer_types": ["compressed_sparse_attention", "sliding_attention", "heavily_compressed_attention",
                            "compressed_sparse_attention", "heavily_compressed_attention"],
            "mlp_layer_types": ["hash_moe", "hash_moe", "hash_moe", "moe", "moe"],
            "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
            "sliding_window": 16, "index_n_heads": 16, "index_head_dim": 32, "index_topk": 8,
            "max_position_embeddings": 16384,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
            "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
            "hc_mult": 3, "hc_sinkhorn_iters": 20,
            "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "partial_rotary_factor": 0.5,
            "rope_parameters": {
                "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "partial_rotary_factor": 0.5,
                             "factor": 4.0, "original_max_position_embeddings": 4096,
                             "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.0},
            },
        },
        "prompts": [{"length": 77, "seed": 31, "chunks": [4, 13]}],
    },
]

# Settings every fixture shares.
COMMON_CONFIG = {
    "num_key_value_heads": 1, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True,
    "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1, "num_nextn_predict_layers": 0, "dtype": "float32",
}


def randomize(model, cfg, gen):
    """Overwrite every parameter and buffer with seeded random values chosen so that each part of the
    model influences the output: normalized activations of order 1, SwiGLU pre-activations of order the
    clamp limit, nonzero sinks, position biases, hc bases and selection biases."""
    limit = cfg.swiglu_limit

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean

    def uniform(shape, lo, hi):
        return torch.rand(shape, generator=gen, dtype=torch.float32) * (hi - lo) + lo

    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            shape = p.shape
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("embed_tokens.weight"):
                value = normal(shape, 1.0)
            elif name.endswith("norm.weight"):
                value = uniform(shape, 0.6, 1.4)
            elif leaf == "sinks":
                value = normal(shape, 1.5)
            elif leaf == "position_bias":
                value = normal(shape, 1.0)
            elif leaf in ("fn", "hc_fn"):
                value = normal(shape, 0.1)
            elif leaf in ("base", "hc_base"):
                value = normal(shape, 0.5)
            elif leaf in ("scale", "hc_scale"):
                value = uniform(shape, 0.5, 1.5)
            elif leaf == "gate_up_proj":
                # Inputs are RMS-normalized (entries ~1): std 0.7*limit/sqrt(D) puts a good share of the
                # gate/up pre-activations beyond +-limit, so the clamp is exercised.
                value = normal(shape, 0.7 * limit / math.sqrt(shape[-1]))
            elif leaf == "down_proj":
                value = normal(shape, 1.0 / (math.sqrt(shape[-1]) * limit))
            elif "shared_experts" in name and ("gate_proj" in name or "up_proj" in name):
                value = normal(shape, 0.7 * limit / math.sqrt(shape[-1]))
            elif "shared_experts" in name and "down_proj" in name:
                value = normal(shape, 1.0 / (math.sqrt(shape[-1]) * limit))
            elif name.endswith("mlp.gate.weight"):
                value = normal(shape, 2.0 / math.sqrt(shape[-1]))
            elif name.endswith("lm_head.weight"):
                value = normal(shape, 3.0 / math.sqrt(shape[-1]))
            elif leaf == "weight" and p.dim() == 2:
                value = normal(shape, 1.0 / math.sqrt(shape[-1]))
            else:
                raise SystemExit(f"mkfixtures: no random init rule for parameter {name} {tuple(shape)}")
            p.copy_(value)
        for name, b in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                b.copy_(normal(b.shape, 0.3))
            elif name.endswith("tid2eid"):
                vocab, k = b.shape
                table = torch.stack([torch.randperm(cfg.n_routed_experts, generator=gen)[:k] for _ in range(vocab)])
                b.copy_(table)
            elif "inv_freq" in name:
                continue
            else:
                raise SystemExit(f"mkfixtures: no random init rule for buffer {name}")


class Probe:
    """Forward hooks that measure clamp activity and the margins of every discrete choice."""

    def __init__(self, model, cfg):
        self.cfg = cfg
        self.enabled = False
        self.reset()
        for layer in model.model.layers:
            experts = layer.mlp.experts
            original = experts._apply_gate

            def apply_gate(gate_up, original=original):
                if self.enabled:
                    gate, up = gate_up.chunk(2, dim=-1)
                    self._count("routed", gate, up)
                return original(gate_up)

            experts._apply_gate = apply_gate
            shared = layer.mlp.shared_experts
            shared.register_forward_pre_hook(self._shared_hook)
            if isinstance(layer.mlp.gate, dsv4.DeepseekV4TopKRouter):
                layer.mlp.gate.register_forward_hook(self._router_hook)
            compressor = layer.self_attn.compressor
            if isinstance(compressor, dsv4.DeepseekV4CSACompressor):
                indexer = compressor.indexer
                indexer.register_forward_pre_hook(self._indexer_pre_hook)
                indexer.scorer.register_forward_hook(
                    lambda mod, args, out, indexer=indexer: self._scorer_hook(indexer, out))

    def reset(self):
        self.clamp = {k: [0, 0, 0, 0] for k in ("routed", "shared")}  # gate>L, up>L, up<-L, total
        self.router_gap = math.inf
        self.bias_changed = 0
        self.index_gap = math.inf
        self.index_dropping_rows = 0
        self.positions = None

    def _count(self, kind, gate, up):
        limit = self.cfg.swiglu_limit
        c = self.clamp[kind]
        c[0] += int((gate > limit).sum())
        c[1] += int((up > limit).sum())
        c[2] += int((up < -limit).sum())
        c[3] += gate.numel()

    def _shared_hook(self, module, args):
        if self.enabled:
            x = args[0]
            self._count("shared", module.gate_proj(x), module.up_proj(x))

    def _router_hook(self, module, args, out):
        if not self.enabled:
            return
        logits = out[0]
        scores = module.score_fn(logits)
        biased = scores + module.e_score_correction_bias
        ordered = biased.sort(dim=-1, descending=True).values
        k = module.top_k
        self.router_gap = min(self.router_gap, float((ordered[:, k - 1] - ordered[:, k]).min()))
        with_bias = biased.topk(k, dim=-1).indices.sort(dim=-1).values
        without = scores.topk(k, dim=-1).indices.sort(dim=-1).values
        self.bias_changed += int((with_bias != without).any(dim=-1).sum())

    def _indexer_pre_hook(self, module, args):
        self.positions = args[2]

    def _scorer_hook(self, indexer, scores):
        if not self.enabled:
            return
        k = indexer.index_topk
        positions = self.positions[0]
        for s in range(scores.shape[1]):
            valid = min(int(positions[s] + 1) // indexer.compress_rate, scores.shape[2])
            if valid <= k:
                continue
            row = scores[0, s, :valid]
            ordered = row.sort(descending=True).values
            scale = float(row.abs().max())
            self.index_gap = min(self.index_gap, float(ordered[k - 1] - ordered[k]) / scale)
            self.index_dropping_rows += 1


def logit_gap(row):
    top = row.topk(2).values
    return float(top[0] - top[1]) / float(row.abs().max())


@torch.no_grad()
def run_case(model, tokens, chunk, decode):
    """Prefill `tokens` (all at once when chunk == 0, else in chunks of `chunk` through the cache), then
    `decode` greedy steps.  Returns logits [(P + decode), V] float32 and the greedy tokens."""
    cache = dsv4.DynamicCache(config=model.config)
    ids = torch.tensor([tokens], dtype=torch.long)
    step = len(tokens) if chunk == 0 else chunk
    rows = []
    for start in range(0, len(tokens), step):
        out = model(input_ids=ids[:, start:start + step], past_key_values=cache, use_cache=True)
        rows.append(out.logits[0])
    greedy = []
    for _ in range(decode):
        nxt = int(rows[-1][-1].argmax())
        greedy.append(nxt)
        out = model(input_ids=torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
        rows.append(out.logits[0])
    return torch.cat(rows, dim=0).float(), greedy


def row_error(a, b):
    return float(((a - b).abs().max(dim=-1).values / b.abs().max(dim=-1).values).max())


def check(cond, what):
    if not cond:
        raise SystemExit(f"mkfixtures: check failed: {what}")


def yarn_report(model):
    rotary = model.model.rotary_emb
    main = rotary.main_inv_freq
    comp = rotary.compress_inv_freq
    return main.tolist(), comp.tolist(), rotary.compress_attention_scaling


def build(spec, out_root):
    name = spec["name"]
    torch.manual_seed(spec["seed"])
    gen = torch.Generator().manual_seed(spec["seed"])
    cfg = DeepseekV4Config(**{**COMMON_CONFIG, **spec["config"]})
    built = DeepseekV4ForCausalLM(cfg).float().eval()
    built.set_attn_implementation("eager")
    built.set_experts_implementation("eager")
    randomize(built, cfg, gen)

    out_dir = os.path.join(out_root, name)
    os.makedirs(out_dir, exist_ok=True)
    for stale in os.listdir(out_dir):
        os.remove(os.path.join(out_dir, stale))
    # transformers' save_pretrained (5.17) renames the weights back towards DeepSeek's release names, and
    # only partly (model.embed_tokens and model.hc_head keep their names, every kv_norm becomes "norm").
    # The fixtures keep the module names of transformers' state_dict instead, the spelling the engine's
    # loader reads as "transformers"; the reload below proves transformers reads them back unchanged.
    cfg.save_pretrained(out_dir)
    built.generation_config.save_pretrained(out_dir)
    state = {k: v.contiguous() for k, v in built.state_dict().items()}
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    model = DeepseekV4ForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager",
                                                  experts_implementation="eager").eval()
    check(len(built.state_dict()) == len(model.state_dict()), f"{name}: reloaded model has other tensors")
    for (n1, t1), (n2, t2) in zip(sorted(built.state_dict().items()), sorted(model.state_dict().items())):
        check(n1 == n2 and torch.equal(t1, t2), f"{name}: reloaded tensor {n2} differs from the built one")
    for m in (built, model):
        check(m.config._attn_implementation == "eager" and m.config._experts_implementation == "eager",
              f"{name}: attention or experts implementation is not eager")

    main_freq, comp_freq, comp_scaling = yarn_report(model)
    rope_type = cfg.rope_parameters["compress"]["rope_type"]
    if rope_type == "yarn":
        plain = 1.0 / (cfg.compress_rope_theta ** (np.arange(0, len(comp_freq) * 2, 2) / (len(comp_freq) * 2)))
        ratio = np.array(comp_freq) / plain
        # YaRN must keep some frequencies and blend at least one with its interpolated value.
        factor = cfg.rope_parameters["compress"]["factor"]
        check(np.isclose(ratio, 1.0).any() and ((ratio < 0.999) & (ratio > 1.0 / factor + 1e-3)).any(),
              f"{name}: YaRN ramp is not partial: {ratio}")
        check(comp_scaling == 1.0, f"{name}: YaRN attention scaling is {comp_scaling}, expected 1.0")

    probe = Probe(model, cfg)
    gen_tokens = torch.Generator()
    cases = []
    summary = {"name": name, "cases": []}
    for pi, prompt in enumerate(spec["prompts"]):
        gen_tokens.manual_seed(prompt["seed"])
        # Token 0 (BOS) first, then random ids; every id of the prompt is routed by tid2eid.
        tokens = [0] + torch.randint(2, cfg.vocab_size, (prompt["length"] - 1,), generator=gen_tokens).tolist()

        probe.reset()
        probe.enabled = True
        logits, greedy = run_case(model, tokens, 0, DECODE)
        probe.enabled = False
        again, greedy_again = run_case(model, tokens, 0, DECODE)
        check(torch.equal(logits, again) and greedy == greedy_again, f"{name} p{pi}: two runs differ")
        if pi == 0:
            b_logits, _ = run_case(built, tokens, 0, DECODE)
            # Bitwise equality is not expected: the mmap-loaded weights can take other BLAS paths.
            reload_err = row_error(b_logits, logits)
            check(reload_err <= ROW_TOLERANCE, f"{name}: reloaded model differs from built one ({reload_err:.2e})")
            summary["reload_err"] = reload_err

        check(torch.isfinite(logits).all(), f"{name} p{pi}: non-finite logits")
        min_gap = min(logit_gap(logits[r]) for r in range(len(tokens) - 1, logits.shape[0]))
        check(min_gap > MIN_LOGIT_GAP_REL, f"{name} p{pi}: greedy argmax near tie ({min_gap:.2e})")
        all_gap = min(logit_gap(logits[r]) for r in range(logits.shape[0]))
        if pi == 0:
            for kind in ("routed", "shared"):
                c = probe.clamp[kind]
                check(c[0] > 0 and c[1] > 0 and c[2] > 0,
                      f"{name}: SwiGLU clamp inactive in {kind} experts (gate>L {c[0]}, up>L {c[1]}, up<-L {c[2]})")
            check(probe.bias_changed > 0, f"{name}: the selection bias never changes a scored-MoE choice")
            check(probe.index_dropping_rows > 0, f"{name}: the indexer never drops an entry")
        check(probe.router_gap > MIN_ROUTER_GAP, f"{name} p{pi}: MoE top-k near tie ({probe.router_gap:.2e})")
        check(probe.index_gap > MIN_INDEX_GAP_REL, f"{name} p{pi}: indexer top-k near tie ({probe.index_gap:.2e})")

        # Cache-free forward over prompt + greedy continuation: the cached path must agree with it.
        full = torch.tensor([tokens + greedy[:-1]])
        with torch.no_grad():
            ref = model(input_ids=full, use_cache=False).logits[0].float()
        nocache_err = row_error(logits[:-1], ref)
        check(nocache_err <= ROW_TOLERANCE, f"{name} p{pi}: cached vs cache-free rows differ ({nocache_err:.2e})")

        variants = [(0, logits, greedy)]
        for chunk in prompt["chunks"]:
            c_logits, c_greedy = run_case(model, tokens, chunk, DECODE)
            err = row_error(c_logits, logits)
            check(err <= ROW_TOLERANCE, f"{name} p{pi}: chunk {chunk} vs one-shot rows differ ({err:.2e})")
            check(c_greedy == greedy, f"{name} p{pi}: chunk {chunk} greedy tokens differ")
            variants.append((chunk, c_logits, c_greedy))
            summary["cases"].append({"prompt": pi, "chunk": chunk, "vs_oneshot": err})

        for chunk, lg, gr in variants:
            case_name = f"p{pi}_" + ("oneshot" if chunk == 0 else f"chunk{chunk}")
            fname = case_name + ".f32"
            lg.numpy().astype("<f4").tofile(os.path.join(out_dir, fname))
            cases.append({"name": case_name, "tokens": tokens, "chunk": chunk, "decode": DECODE,
                          "logits": fname, "rows": int(lg.shape[0]), "vocab": cfg.vocab_size, "greedy": gr})
        summary["cases"].append({
            "prompt": pi, "length": len(tokens), "chunk": 0, "nocache_err": nocache_err,
            "min_greedy_gap": min_gap, "min_any_row_gap": all_gap, "router_gap": probe.router_gap,
            "index_gap": probe.index_gap, "index_dropping_rows": probe.index_dropping_rows,
            "bias_changed": probe.bias_changed, "greedy": greedy,
            "clamp": {k: {"gate>L": v[0], "up>L": v[1], "up<-L": v[2], "of": v[3]}
                      for k, v in probe.clamp.items()},
        })

    with open(os.path.join(out_dir, "cases.json"), "w") as f:
        json.dump(cases, f, indent=1)
        f.write("\n")
    summary["compress_inv_freq"] = comp_freq
    summary["main_inv_freq"] = main_freq
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures"))
    parser.add_argument("--only", action="append", help="build only this model (repeatable)")
    args = parser.parse_args()
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    if (major, minor) < (5, 8):
        raise SystemExit(f"mkfixtures: transformers >= 5.8 needed, found {transformers.__version__}")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    for spec in MODELS:
        if args.only and spec["name"] not in args.only:
            continue
        summary = build(spec, args.out)
        json.dump(summary, sys.stdout, indent=1)
        sys.stdout.write("\n")


if __name__ == "__main__":
    main()
