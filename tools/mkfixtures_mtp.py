#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Build the MTP oracle fixtures: a tiny DeepSeek-V4 model with its multi-token-prediction block, and
what an independent PyTorch implementation of that block computes for it.

transformers' deepseek_v4 drops MTP weights (it builds no MTP block), so the oracle is tools/mtp_block.py,
written from its modules (doc/MODEL.md §3.9).

For each base fixture (tests/fixtures/<base>/, made by tools/mkfixtures.py) the script loads the model with
transformers, draws an MTP block from a fixed seed (same rules as mkfixtures.randomize), and writes
tests/fixtures/<base>_mtp/: the base config with num_nextn_predict_layers 1, the base weights unchanged
plus the block's (names below), and cases_mtp.json with one case per base case prompt:

    {"name": "p0", "tokens": [...], "logits": "p0_mtp.f32", "rows": N - 1, "vocab": V}

tokens: the base case's prompt followed by its greedy tokens (N ids); row p (0 <= p < N - 1): the MTP
logits for the streams of position p and the token tokens[p + 1] (a prediction of tokens[p + 2]).

Asserted before writing: the base model reloaded here reproduces the base fixture's logits; the block run
one token at a time through transformers' cache equals the cache-free run (rows within 2e-5 x max |logit|);
two runs are bitwise identical; no scored-MoE near tie in the block (gap >= 1e-4).

Usage: python3 tools/mkfixtures_mtp.py [--fixtures tests/fixtures]
"""

import argparse
import json
import os
import sys

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4ForCausalLM
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as dsv4

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mkfixtures  # noqa: E402  (randomize, tolerances, checks)
from mtp_block import MTPBlock, main_streams_hook  # noqa: E402

# Base fixture -> seed of its MTP block's weights.
BASES = {"tiny_a": 1078, "tiny_b": 2077}


class RouterProbe:
    def __init__(self, router):
        self.gap = float("inf")
        router.register_forward_hook(self.hook)

    def hook(self, module, args, out):
        scores = module.score_fn(out[0]) + module.e_score_correction_bias
        ordered = scores.sort(dim=-1, descending=True).values
        k = module.top_k
        self.gap = min(self.gap, float((ordered[:, k - 1] - ordered[:, k]).min()))


@torch.no_grad()
def main_streams(model, tokens):
    """Cache-free forward: the final streams [1, N, hc, D] (hc_head's input) and the logits [N, V]."""
    seen = {}
    h = main_streams_hook(model, seen)
    logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float()
    h.remove()
    return seen["x"], logits


@torch.no_grad()
def mtp_rows(block, model, streams, tokens, cached):
    n = len(tokens) - 1
    nxt = torch.tensor([tokens[1:]])
    if not cached:
        return block(model, streams[:, :n], nxt, torch.arange(n).unsqueeze(0))[0].float()
    cache = dsv4.DynamicCache(config=block.cfg)
    rows = [block(model, streams[:, p:p + 1], nxt[:, p:p + 1], torch.tensor([[p]]), cache)[0]
            for p in range(n)]
    return torch.cat(rows, dim=0).float()


def build(base, seed, root):
    src = os.path.join(root, base)
    model = DeepseekV4ForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager",
                                                  experts_implementation="eager").eval()
    cfg = model.config
    torch.manual_seed(seed)
    block = MTPBlock(cfg).float().eval()
    mkfixtures.check(block.cfg._attn_implementation == "eager" and block.cfg._experts_implementation == "eager",
                     f"{base}: the MTP layer's attention or experts implementation is not eager")
    mkfixtures.randomize(block, cfg, torch.Generator().manual_seed(seed))
    probe = RouterProbe(block.layer.mlp.gate)

    with open(os.path.join(src, "cases.json")) as f:
        base_cases = json.load(f)
    out_dir = os.path.join(root, base + "_mtp")
    os.makedirs(out_dir, exist_ok=True)
    for stale in os.listdir(out_dir):
        os.remove(os.path.join(out_dir, stale))
    cases, summary = [], {"name": base + "_mtp", "seed": seed, "cases": []}
    for bc in base_cases:
        if bc["chunk"] != 0:
            continue
        tokens = bc["tokens"] + bc["greedy"]
        ref = np.fromfile(os.path.join(src, bc["logits"]), dtype="<f4").reshape(bc["rows"], bc["vocab"])
        streams, logits = main_streams(model, tokens)
        # The last greedy token is never fed in the base case: its rows are the first N - 1.
        main_err = mkfixtures.row_error(logits[:-1], torch.from_numpy(ref[:-1]))
        mkfixtures.check(main_err <= 1e-4, f"{base}: reloaded base model differs from its fixture ({main_err:.2e})")
        probe.gap = float("inf")
        rows = mtp_rows(block, model, streams, tokens, cached=False)
        again = mtp_rows(block, model, streams, tokens, cached=False)
        mkfixtures.check(torch.equal(rows, again), f"{base}: two MTP runs differ")
        stepped = mtp_rows(block, model, streams, tokens, cached=True)
        step_err = mkfixtures.row_error(stepped, rows)
        mkfixtures.check(step_err <= mkfixtures.ROW_TOLERANCE,
                         f"{base}: MTP one token at a time vs cache-free differ ({step_err:.2e})")
        mkfixtures.check(torch.isfinite(rows).all(), f"{base}: non-finite MTP logits")
        mkfixtures.check(probe.gap > mkfixtures.MIN_ROUTER_GAP, f"{base}: MTP MoE top-k near tie ({probe.gap:.2e})")
        name = bc["name"].split("_")[0]
        fname = name + "_mtp.f32"
        rows.numpy().astype("<f4").tofile(os.path.join(out_dir, fname))
        cases.append({"name": name, "tokens": tokens, "logits": fname, "rows": int(rows.shape[0]),
                      "vocab": cfg.vocab_size})
        summary["cases"].append({"case": name, "rows": int(rows.shape[0]), "main_vs_fixture": main_err,
                                 "stepped_vs_cachefree": step_err, "router_gap": probe.gap})

    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["num_nextn_predict_layers"] = 1
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    with open(os.path.join(src, "generation_config.json")) as f:
        gen_cfg = f.read()
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        f.write(gen_cfg)
    state = load_file(os.path.join(src, "model.safetensors"))
    state.update(block.release_state())
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "cases_mtp.json"), "w") as f:
        json.dump(cases, f, indent=1)
        f.write("\n")
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fixtures", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures"))
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    for base, seed in BASES.items():
        json.dump(build(base, seed, args.fixtures), sys.stdout, indent=1)
        sys.stdout.write("\n")


if __name__ == "__main__":
    main()
