#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Convert a transformers-spelled DeepSeek-V4 checkpoint (what tools/train_default.py writes) into
DeepSeek's release spelling and formats (doc/MODEL.md §2):

  names        embed.weight, head.weight, norm.weight, hc_head_{fn,base,scale},
               layers.i.{attn_norm,ffn_norm}.weight, layers.i.hc_{attn,ffn}_{fn,base,scale},
               layers.i.attn.{wq_a,q_norm,wq_b,wkv,kv_norm,wo_a,wo_b}.weight, layers.i.attn.attn_sink,
               layers.i.attn.compressor.{wkv,wgate,norm}.weight + .ape,
               layers.i.attn.indexer.{wq_b,weights_proj}.weight,
               layers.i.attn.indexer.compressor.{wkv,wgate,norm}.weight + .ape,
               layers.i.ffn.gate.{weight,bias,tid2eid}, layers.i.ffn.experts.E.{w1,w2,w3}.weight,
               layers.i.ffn.shared_experts.{w1,w2,w3}.weight;
               an MTP block k (model.mtp.k.*, tools/mtp_block.py): its layer under mtp.k. as a layer's,
               and mtp.k.{enorm,hnorm,norm,e_proj,h_proj}.weight, mtp.k.hc_head_{fn,base,scale}
  FP8          wq_a, wq_b, wkv, wo_a, wo_b, indexer wq_b, shared experts: e4m3fn [F8_E4M3] with one
               UE8M0 scale [F8_E8M0] per 128x128 block in <name>.scale [ceil(out/128), ceil(in/128)]
  FP4          routed experts w1/w2/w3: e2m1 two a byte, low nibble first along K [I8, out x in/2],
               one UE8M0 scale per 1x32 block along K [F8_E8M0, out x in/32]
  BF16         embed, head, norms, compressor wkv/wgate, indexer weights_proj, gate weight, MTP e_proj/h_proj
  F32          hc_* tensors, attn_sink, compressor ape, gate bias;  I32 tid2eid

Every block scale is the smallest power of two s with amax/s <= the format's largest value (448 for
e4m3, 6 for e2m1), so no value saturates; values are rounded to nearest, ties to even (for e2m1
exactly as engine/model/quant.c's dsv4_f32_to_e2m1, sign kept on zero). A block of zeros gets the
smallest scale, 2^-127. Dequantized values (code * scale) are exactly representable in BF16, so
--dequantized DIR can write them back in the transformers spelling: transformers then computes
what the quantized checkpoint means under exact numerics.

config.json is DeepSeek's inference config (ModelArgs of the release's inference code: dim,
n_layers, compress_ratios, ...); that form spells any compress ratio per layer (transformers'
legacy compress_ratios only takes 0/4/128, and this model's HCA ratio is 16).

  python3 tools/convert_release.py models/default models/default-fp8 [--dequantized DIR]
"""
import argparse
import json
import os
import shutil
import struct
import sys

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

FP8_BLOCK = 128                 # 128x128 weight blocks share one scale
FP4_BLOCK = 32                  # 1x32 blocks along K share one scale
E4M3_MAX, E2M1_MAX = 448.0, 6.0
UE8M0_BIAS = 127
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])

# transformers name (after "model.layers.i.") -> (release name, format); experts are handled apart.
LAYER_MAP = {
    "input_layernorm.weight": ("attn_norm.weight", "bf16"),
    "post_attention_layernorm.weight": ("ffn_norm.weight", "bf16"),
    "attn_hc.fn": ("hc_attn_fn", "f32"),
    "attn_hc.base": ("hc_attn_base", "f32"),
    "attn_hc.scale": ("hc_attn_scale", "f32"),
    "ffn_hc.fn": ("hc_ffn_fn", "f32"),
    "ffn_hc.base": ("hc_ffn_base", "f32"),
    "ffn_hc.scale": ("hc_ffn_scale", "f32"),
    "self_attn.q_a_proj.weight": ("attn.wq_a.weight", "fp8"),
    "self_attn.q_a_norm.weight": ("attn.q_norm.weight", "bf16"),
    "self_attn.q_b_proj.weight": ("attn.wq_b.weight", "fp8"),
    "self_attn.kv_proj.weight": ("attn.wkv.weight", "fp8"),
    "self_attn.kv_norm.weight": ("attn.kv_norm.weight", "bf16"),
    "self_attn.o_a_proj.weight": ("attn.wo_a.weight", "fp8"),
    "self_attn.o_b_proj.weight": ("attn.wo_b.weight", "fp8"),
    "self_attn.sinks": ("attn.attn_sink", "f32"),
    "self_attn.compressor.kv_proj.weight": ("attn.compressor.wkv.weight", "bf16"),
    "self_attn.compressor.gate_proj.weight": ("attn.compressor.wgate.weight", "bf16"),
    "self_attn.compressor.position_bias": ("attn.compressor.ape", "f32"),
    "self_attn.compressor.kv_norm.weight": ("attn.compressor.norm.weight", "bf16"),
    "self_attn.compressor.indexer.kv_proj.weight": ("attn.indexer.compressor.wkv.weight", "bf16"),
    "self_attn.compressor.indexer.gate_proj.weight": ("attn.indexer.compressor.wgate.weight", "bf16"),
    "self_attn.compressor.indexer.position_bias": ("attn.indexer.compressor.ape", "f32"),
    "self_attn.compressor.indexer.kv_norm.weight": ("attn.indexer.compressor.norm.weight", "bf16"),
    "self_attn.compressor.indexer.q_b_proj.weight": ("attn.indexer.wq_b.weight", "fp8"),
    "self_attn.compressor.indexer.scorer.weights_proj.weight": ("attn.indexer.weights_proj.weight", "bf16"),
    "mlp.gate.weight": ("ffn.gate.weight", "bf16"),
    "mlp.gate.tid2eid": ("ffn.gate.tid2eid", "i32"),
    "mlp.gate.e_score_correction_bias": ("ffn.gate.bias", "f32"),
    "mlp.shared_experts.gate_proj.weight": ("ffn.shared_experts.w1.weight", "fp8"),
    "mlp.shared_experts.up_proj.weight": ("ffn.shared_experts.w3.weight", "fp8"),
    "mlp.shared_experts.down_proj.weight": ("ffn.shared_experts.w2.weight", "fp8"),
}
TOP_MAP = {
    "model.embed_tokens.weight": ("embed.weight", "bf16"),
    "lm_head.weight": ("head.weight", "bf16"),
    "model.norm.weight": ("norm.weight", "bf16"),
    "model.hc_head.hc_fn": ("hc_head_fn", "f32"),
    "model.hc_head.hc_base": ("hc_head_base", "f32"),
    "model.hc_head.hc_scale": ("hc_head_scale", "f32"),
}
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# An MTP block's own tensors (after "model.mtp.k."), besides its layer's.
MTP_MAP = {
    "enorm.weight": ("enorm.weight", "bf16"),
    "hnorm.weight": ("hnorm.weight", "bf16"),
    "norm.weight": ("norm.weight", "bf16"),
    "e_proj.weight": ("e_proj.weight", "bf16"),
    "h_proj.weight": ("h_proj.weight", "bf16"),
    "hc_head_fn": ("hc_head_fn", "f32"),
    "hc_head_base": ("hc_head_base", "f32"),
    "hc_head_scale": ("hc_head_scale", "f32"),
}


def ue8m0_exponents(amax, fmt_max):
    """Per block: the UE8M0 byte of the smallest power of two s with amax/s <= fmt_max (0 for a
    block of zeros). frexp splits amax/fmt_max = fr * 2^ex, fr in [0.5, 1); exact powers of two
    (fr == 0.5) need ex - 1."""
    fr, ex = np.frexp(amax.astype(np.float64) / fmt_max)
    ex = np.where(fr == 0.5, ex - 1, ex) + UE8M0_BIAS
    ex = np.where(amax > 0, ex, 0)
    if (ex < 0).any() or (ex > 254).any():
        raise ValueError("a block's scale is outside UE8M0's range (2^-127 .. 2^127)")
    return ex.astype(np.uint8)


def scale_values(ex):
    return np.ldexp(1.0, ex.astype(np.int64) - UE8M0_BIAS)


def quantize_fp8(w):
    """w [out, in] float -> (e4m3 bytes [out, in], UE8M0 bytes [ceil(out/128), ceil(in/128)],
    dequantized float64 [out, in])."""
    out, inn = w.shape
    bo, bi = -(-out // FP8_BLOCK), -(-inn // FP8_BLOCK)
    pad = np.zeros((bo * FP8_BLOCK, bi * FP8_BLOCK))
    pad[:out, :inn] = np.abs(w)
    amax = pad.reshape(bo, FP8_BLOCK, bi, FP8_BLOCK).max(axis=(1, 3))
    ex = ue8m0_exponents(amax, E4M3_MAX)
    s = np.repeat(np.repeat(scale_values(ex), FP8_BLOCK, 0), FP8_BLOCK, 1)[:out, :inn]
    # torch rounds float32 to e4m3fn to nearest, ties to even; w/s is exact (s a power of two)
    q = torch.from_numpy((w / s).astype(np.float32)).to(torch.float8_e4m3fn)
    deq = q.float().numpy().astype(np.float64) * s
    return q.view(torch.uint8).numpy(), ex, deq


def e2m1_codes(x):
    """Nearest e2m1 code of each value of x (|x| <= 6 here), ties to the even code; sign bit 0x8
    from the sign of x, zero included, as dsv4_f32_to_e2m1 does."""
    a = np.abs(x)
    d = np.abs(a[..., None] - E2M1_GRID)
    best = np.zeros(a.shape, dtype=np.int64)
    for c in range(1, len(E2M1_GRID)):
        dc, db = d[..., c], np.take_along_axis(d, best[..., None], -1)[..., 0]
        best = np.where((dc < db) | ((dc == db) & (c % 2 == 0)), c, best)
    return (best | np.where(np.signbit(x), 0x8, 0)).astype(np.uint8)


def quantize_fp4(w):
    """w [out, in] float -> (packed I8 [out, in/2], UE8M0 bytes [out, in/32], dequantized float64)."""
    out, inn = w.shape
    if inn % FP4_BLOCK:
        raise ValueError("FP4 needs an input width divisible by %d, got %d" % (FP4_BLOCK, inn))
    blocks = w.reshape(out, inn // FP4_BLOCK, FP4_BLOCK)
    ex = ue8m0_exponents(np.abs(blocks).max(axis=2), E2M1_MAX)
    s = scale_values(ex)[..., None]
    codes = e2m1_codes(blocks / s).reshape(out, inn)
    mag = E2M1_GRID[codes & 0x7] * np.where(codes & 0x8, -1.0, 1.0)
    deq = (mag.reshape(out, inn // FP4_BLOCK, FP4_BLOCK) * s).reshape(out, inn)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).view(np.int8)
    return packed, ex, deq


class Writer:
    """A single-file safetensors writer that takes F8_E4M3/F8_E8M0/I8 bytes as they are."""

    def __init__(self):
        self.tensors = []       # (name, dtype, shape, bytes)

    def add(self, name, dtype, shape, data):
        self.tensors.append((name, dtype, list(shape), np.ascontiguousarray(data).tobytes()))

    def write(self, path, metadata):
        header, off = {"__metadata__": metadata}, 0
        for name, dtype, shape, data in sorted(self.tensors):
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(data)]}
            off += len(data)
        h = json.dumps(header, separators=(",", ":")).encode()
        h += b" " * (-len(h) % 8)       # keep tensor data 8-byte aligned
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(h)))
            f.write(h)
            for _, _, _, data in sorted(self.tensors):
                f.write(data)


def bf16_bits(t):
    return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def release_config(hf):
    """DeepSeek's inference config (ModelArgs) for a transformers DeepseekV4Config dict."""
    n = hf["num_hidden_layers"]
    rates = hf["compress_rates"]
    ratio_of = {"sliding_attention": 0, "compressed_sparse_attention": rates["compressed_sparse_attention"],
                "heavily_compressed_attention": rates["heavily_compressed_attention"]}
    mlp = hf["mlp_layer_types"][:n]
    n_hash = sum(1 for t in mlp if t == "hash_moe")
    if mlp != ["hash_moe"] * n_hash + ["moe"] * (n - n_hash):
        raise ValueError("mlp_layer_types must be hash_moe layers first: the release config counts them")
    if rates["compressed_sparse_attention"] != 4:
        raise ValueError("the release config makes ratio 4 the CSA layers; this model's CSA rate is %d"
                         % rates["compressed_sparse_attention"])
    rp = hf["rope_parameters"]
    main, comp = rp["main"], rp["compress"]
    if main.get("rope_type", "default") != "default" or comp.get("rope_type") != "yarn":
        raise ValueError("expected plain RoPE on sliding layers and YaRN on compressed ones")
    if comp.get("attention_factor", 1.0) != 1.0:
        raise ValueError("the release applies no YaRN attention factor")
    rope_dim = int(hf["head_dim"] * main["partial_rotary_factor"])
    if rope_dim != int(hf["head_dim"] * comp["partial_rotary_factor"]):
        raise ValueError("main and compress rotary dims differ")
    if hf["num_key_value_heads"] != 1 or hf["n_shared_experts"] != 1 or hf["tie_word_embeddings"]:
        raise ValueError("the release form has one KV head, one shared expert and an untied head")
    return {
        "vocab_size": hf["vocab_size"], "dim": hf["hidden_size"], "moe_inter_dim": hf["moe_intermediate_size"],
        "n_layers": n, "n_hash_layers": n_hash, "n_mtp_layers": hf["num_nextn_predict_layers"],
        "n_heads": hf["num_attention_heads"], "n_routed_experts": hf["n_routed_experts"],
        "n_shared_experts": hf["n_shared_experts"], "n_activated_experts": hf["num_experts_per_tok"],
        "score_func": hf["scoring_func"], "route_scale": hf["routed_scaling_factor"],
        "swiglu_limit": hf["swiglu_limit"], "q_lora_rank": hf["q_lora_rank"], "head_dim": hf["head_dim"],
        "rope_head_dim": rope_dim, "norm_eps": hf["rms_norm_eps"], "o_groups": hf["o_groups"],
        "o_lora_rank": hf["o_lora_rank"], "window_size": hf["sliding_window"],
        "compress_ratios": [ratio_of[t] for t in hf["layer_types"][:n]],
        "compress_rope_theta": comp["rope_theta"], "original_seq_len": comp["original_max_position_embeddings"],
        "rope_theta": main["rope_theta"], "rope_factor": comp["factor"], "beta_fast": comp["beta_fast"],
        "beta_slow": comp["beta_slow"], "index_n_heads": hf["index_n_heads"],
        "index_head_dim": hf["index_head_dim"], "index_topk": hf["index_topk"], "hc_mult": hf["hc_mult"],
        "hc_sinkhorn_iters": hf["hc_sinkhorn_iters"], "hc_eps": hf["hc_eps"],
        "dtype": "fp8", "scale_fmt": "ue8m0", "expert_dtype": "fp4",
    }


def convert(src, dst, deq_dir):
    with open(os.path.join(src, "config.json")) as f:
        hf_cfg = json.load(f)
    cfg = release_config(hf_cfg)
    w = Writer()
    deq = {}                    # transformers name -> dequantized tensor (for --dequantized)
    stats = {"fp8": 0, "fp4": 0, "bf16": 0, "f32": 0, "i32": 0}
    err = {"fp8": 0.0, "fp4": 0.0}      # largest |w - dq(q(w))| / block scale, a rounding check
    with safe_open(os.path.join(src, "model.safetensors"), "pt") as f:
        names = set(f.keys())
        todo = []
        for name in sorted(names):
            if name in TOP_MAP:
                todo.append((name, TOP_MAP[name]))
                continue
            parts = name.split(".", 3)
            if len(parts) == 4 and parts[0] == "model" and parts[1] in ("layers", "mtp") and parts[2].isdigit():
                rel, base = parts[3], "%s.%s." % (parts[1], parts[2])
                if parts[1] == "mtp" and int(parts[2]) >= cfg["n_mtp_layers"]:
                    raise ValueError("%s: tensor %s of an MTP block the config does not count" % (src, name))
                if parts[1] == "mtp" and rel in MTP_MAP:
                    new, fmt = MTP_MAP[rel]
                    todo.append((name, (base + new, fmt)))
                    continue
                if rel in LAYER_MAP:
                    new, fmt = LAYER_MAP[rel]
                    todo.append((name, (base + new, fmt)))
                    continue
                if rel in EXPERTS:
                    todo.append((name, (base, "experts")))
                    continue
            raise ValueError("%s: no release name for tensor %s" % (src, name))
        for name, (new, fmt) in todo:
            t = f.get_tensor(name)
            if fmt == "bf16":
                w.add(new, "BF16", t.shape, bf16_bits(t))
                deq[name] = t.to(torch.bfloat16)
            elif fmt == "f32":
                w.add(new, "F32", t.shape, t.float().numpy())
                deq[name] = t.float()
            elif fmt == "i32":
                w.add(new, "I32", t.shape, t.numpy().astype(np.int32))
                deq[name] = t
            elif fmt == "fp8":
                x = t.float().numpy().astype(np.float64)
                q, ex, d = quantize_fp8(x)
                w.add(new, "F8_E4M3", q.shape, q)
                w.add(new[:-len(".weight")] + ".scale", "F8_E8M0", ex.shape, ex)
                deq[name] = as_bf16(d, new)
                err["fp8"] = max(err["fp8"], rounding_error(x, d, ex, FP8_BLOCK, FP8_BLOCK))
            else:
                x = t.float().numpy().astype(np.float64)
                E = x.shape[0]
                out = np.empty_like(x)
                for e in range(E):
                    if name.endswith("gate_up_proj"):
                        I = x.shape[1] // 2
                        mats = [("w1", x[e, :I], slice(0, I)), ("w3", x[e, I:], slice(I, 2 * I))]
                    else:
                        mats = [("w2", x[e], slice(None))]
                    for wn, m, rows in mats:
                        q, ex, d = quantize_fp4(m)
                        ename = "%sffn.experts.%d.%s" % (new, e, wn)
                        w.add(ename + ".weight", "I8", q.shape, q)
                        w.add(ename + ".scale", "F8_E8M0", ex.shape, ex)
                        out[e, rows] = d
                        err["fp4"] = max(err["fp4"], rounding_error(m, d, ex, 1, FP4_BLOCK))
                        stats["fp4"] += 1
                deq[name] = as_bf16(out, name)
                continue
            stats[fmt] += 1
    # Round to nearest: no value moves by more than half a code step, in block-scale units 16 for
    # e4m3 (step 32 in its top binade, 256..448) and 1 for e2m1 (step 2 between 4 and 6).
    if err["fp8"] > 16.0 or err["fp4"] > 1.0:
        raise AssertionError("rounding error above half a code step: %r" % err)

    os.makedirs(dst, exist_ok=True)
    w.write(os.path.join(dst, "model.safetensors"), {"format": "pt"})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
        f.write("\n")
    for extra in ("tokenizer.json", "generation_config.json"):
        shutil.copyfile(os.path.join(src, extra), os.path.join(dst, extra))
    print("convert_release: %s -> %s: %d FP8, %d FP4, %d BF16, %d F32, %d I32 tensors (scales apart), "
          "%.2f MB" % (src, dst, stats["fp8"], stats["fp4"], stats["bf16"], stats["f32"], stats["i32"],
                       os.path.getsize(os.path.join(dst, "model.safetensors")) / 1e6))

    if deq_dir:
        os.makedirs(deq_dir, exist_ok=True)
        for extra in ("config.json", "tokenizer.json", "generation_config.json"):
            shutil.copyfile(os.path.join(src, extra), os.path.join(deq_dir, extra))
        save_file({k: v.contiguous() for k, v in deq.items()}, os.path.join(deq_dir, "model.safetensors"),
                  metadata={"format": "pt"})
        print("convert_release: dequantized transformers checkpoint in %s" % deq_dir)


def as_bf16(d, name):
    """Dequantized values as BF16, which holds them exactly (3 or 1 mantissa bits times a power of
    two); checked, so --dequantized writes the quantized model's values, not a rounding of them."""
    t = torch.from_numpy(d).to(torch.bfloat16)
    if not np.array_equal(t.double().numpy(), d):
        raise AssertionError("dequantized %s is not exact in BF16" % name)
    return t


def rounding_error(x, d, ex, br, bc):
    """Largest |x - d| in units of each value's block scale."""
    s = scale_values(ex)
    s = np.repeat(np.repeat(s, br, 0), bc, 1)[:x.shape[0], :x.shape[1]]
    return float((np.abs(x - d) / s).max())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src", help="transformers-spelled model directory (config.json, model.safetensors, tokenizer.json)")
    ap.add_argument("dst", help="output directory for the release-format model")
    ap.add_argument("--dequantized", metavar="DIR",
                    help="also write the dequantized weights in the transformers spelling (BF16) to DIR")
    a = ap.parse_args()
    try:
        convert(a.src, a.dst, a.dequantized)
    except (ValueError, OSError, KeyError) as e:
        sys.exit("convert_release: %s" % e)


if __name__ == "__main__":
    main()
