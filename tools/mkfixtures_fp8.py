#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Build the oracle for the `fp8` ("official") numerics of the tiny DeepSeek-V4 fixtures.

For every tests/fixtures/<model>/ made by tools/mkfixtures.py this loads the model with transformers'
deepseek_v4 (float32, eager attention and experts, CPU), wraps its modules with hooks that round the
caches the way DeepSeek's reference inference code does (doc/MODEL.md §2-5), and runs the prompts of
cases.json again: one-shot and chunked prefill, then greedy decode on the fp8 model's own argmax.  It
writes cases_fp8.json (the cases.json format) and <case>.fp8.f32 logits beside the exact ones.

Where each rounding happens (DeepSeek's V4 inference model.py, the Attention / Compressor / Indexer
forwards, and its kernel.py quantizers), and how it is reproduced here:
  * window KV: kv = kv_norm(wkv x), RoPE on the last rope_dim values, then the first head_dim - rope_dim
    ("nope") values are rounded in place through FP8 e4m3 in blocks of 64 with a UE8M0 scale; the rounded
    vector is what the window ring stores, what the token itself attends to, and the value too (K = V).
    The RoPE slice is rounded to bf16: the reference keeps it in BF16 ("for positional precision", its
    whole model runs in BF16) and the cache entry of doc/MODEL.md §5.2 stores it as 64 bf16 values; this
    numerics is the caches as the official layout stores them (doc/MODEL.md §4.2), everything else f32.
    Both roundings act on the vector after RoPE: the kv_norm output is marked by a forward hook on
    self_attn.kv_norm, and the wrapped apply_rotary_pos_emb rounds its result for a marked input.
  * compressed entries (CSA and HCA compressors): RMSNorm, RoPE at the block's first position, then the
    same roundings (nope FP8, RoPE slice bf16) before the entry enters the compressed cache: the same
    mark on the compressor's kv_norm.
  * indexer keys: the indexer compressor's entry gets RoPE, then the Hadamard rotation of all
    index_head_dim values scaled by index_head_dim^-0.5, then FP4 e2m1 rounding of all of them in blocks
    of 32 with UE8M0 scales.  The Hadamard must follow RoPE, so this cannot sit at kv_norm: a pre-hook on
    the indexer's scorer rotates and rounds the keys it receives.  The cache keeps the unrotated entries
    and the scorer rotates all of them on every call, which gives the same values as rounding once at
    insertion (the rounding is a function of the entry alone).
  * indexer queries: q = wq_b(qr) per head, RoPE, Hadamard, FP4 (same blocks): the same pre-hook.
  * indexer weights: weights_proj(x) * index_head_dim^-0.5 * index_n_heads^-0.5 in the reference, not
    rounded (a BF16 linear); transformers' scorer computes the same product.  Scores are
    sum_h w_h ReLU(q_h . k_s) on the rounded q and k.
  * the main attention's queries are not rounded (the reference keeps q in BF16 and attends over the
    dequantized cache).
  * activations entering a linear are quantized (1x128 e4m3, UE8M0) only when that linear's weight is
    FP8 or FP4 (the reference's linear() dispatches on the weight dtype; a BF16/F32 weight takes a plain
    matmul).  The fixtures' weights are all F32, so no activation is quantized in them; --fp8-weights
    writes a variant of tiny_a with FP8 linears and runs its oracle with this quantization (a pre-hook on
    each such linear; wo_a's input stays unquantized: the reference dequantizes wo_a and runs BF16).
  * UE8M0 scales, as kernel.py computes them: FP8 s = 2^ceil(log2(max(amax, 1e-4) * f32(1/448)));
    FP4 s = 2^ceil(log2(max(amax, 6 * 2^-126) * f32(1/6))); values are x / s clamped to the format's
    maximum, rounded to nearest even.  A block shorter than its nominal size (the tiny models' nope slice
    is 24 or 48 values, the index heads 16 or 32) takes its own scale over the values it has.
FP8 rounding uses torch.float8_e4m3fn casts (checked against an explicit nearest-even grid rounding);
FP4 rounds explicitly to the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}; the Hadamard matrix is Sylvester's,
applied in float64.

Everything else is transformers' float32 computation, the "exact" numerics of the fixtures.

Two implementations computing the same float32 values up to rounding order make the same FP8/FP4/bf16
choice unless a value lies within that noise of a rounding boundary, and with 10^4 to 10^5 roundings per
case some always do (the closest sit 1e-8 of their block's amax away).  A rounding that goes the other
way moves the later rows a little, or a lot when it reorders an indexer or router top-k.  So each row
gets its own bound, measured here: every rounding within FLIP_DISTANCE (relative to its block's amax) of
its boundary, and every scale within FLIP_DISTANCE of a power of two, is taken to the other side, all at
once and then each half of a random split (teacher-forced on the same tokens); the row's bound is
FLIP_SAFETY times the largest move seen, and never below BASE_TOLERANCE (the exact numerics' 1e-4).  The
values before rounding move by 1e-6 to 2e-6 (99.9th percentile, relative to their row's amax) between
one-shot and chunked prefill of the same prompt when no rounding flips between them; FLIP_DISTANCE is
above that.  The script also requires chunked == one-shot (the chunked cases decode the one-shot case's
tokens) and cached decode == one cache-free forward within those bounds, with the same argmax wherever the
top-2 gap exceeds twice the bound: the same comparison the C backend faces, two float32 paths that differ
in rounding order only.

Importing this module replaces transformers' deepseek_v4 apply_rotary_pos_emb by a wrapper that is a
pass-through for every tensor not marked by the hooks.

Usage: python3 tools/mkfixtures_fp8.py [--fixtures tests/fixtures] [--only tiny_a] [--fp8-weights DIR]
"""

import argparse
import json
import math
import os
import shutil
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import DeepseekV4ForCausalLM
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as dsv4

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mkfixtures  # noqa: E402  (the exact fixtures' runner, probes and checks)

KV_BLOCK = 64            # FP8 KV cache: one UE8M0 scale per 64 nope values
FP4_BLOCK = 32           # indexer keys and queries: one UE8M0 scale per 32 values
E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP8_AMAX_FLOOR = 1e-4
FP4_AMAX_FLOOR = 6.0 * 2.0 ** -126
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
ACT_BLOCK = 128          # activations entering an FP8/FP4 linear: one UE8M0 scale per 1x128
WEIGHT_BLOCK = 128       # FP8 weights: one UE8M0 scale per 128x128
# Greedy decode steps after each prompt (as many as the exact fixtures).
DECODE = 16
# --fp8-weights: a variant of an exact fixture's model with the linears DeepSeek ships in FP8 (transformers'
# names) stored as e4m3 with UE8M0 128x128 scales and every other float tensor as bf16, and its oracle
# with activation quantization; for a manual check only (README_fp8.md says why it is not shipped).
FP8_WEIGHT_BASE, FP8_WEIGHT_CASES = "tiny_a", ["p0_oneshot"]
FP8_LINEARS = ("self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_proj.weight",
               "self_attn.o_a_proj.weight", "self_attn.o_b_proj.weight", "indexer.q_b_proj.weight",
               "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
               "shared_experts.down_proj.weight")
# wo_a ships in FP8 but the reference dequantizes it and runs a BF16 einsum: its input is not quantized.
RAW_INPUT_LINEARS = ("self_attn.o_a_proj.weight",)
# Values this close to a rounding boundary (relative to their block's amax; scales: relative distance of
# amax/max to a power of two) may round the other way in another float32 implementation.
FLIP_DISTANCE = 3e-6
# Row tolerance: the exact numerics' 1e-4, or FLIP_SAFETY times the row's measured flip sensitivity.
BASE_TOLERANCE = 1e-4
FLIP_SAFETY = 2.0
FLIP_SEED = 8
# MoE router (score units) and indexer (relative to the row's max |score|) top-k gaps: 10x the noise.
MIN_SELECTION_GAP = 1e-5


def pow2_ceil(r):
    """2^ceil(log2(r)) for positive normal float32 r, on the exponent bits like kernel.py."""
    mant, exp = torch.frexp(r)
    exp = torch.where(mant == 0.5, exp - 1, exp)
    return torch.ldexp(torch.ones_like(r), exp)


def pow2_distance(r):
    """|r / 2^k - 1| for the power of two 2^k nearest to r (how far a scale is from flipping)."""
    k = torch.round(torch.log2(r.double()))
    return (r.double() / torch.pow(2.0, k) - 1.0).abs()


def grid_margin(v, grid):
    """Distance of each |v| to the nearest rounding boundary (midpoint) of a non-negative value grid."""
    mids = (grid[1:] + grid[:-1]) / 2
    a = v.abs().double().reshape(-1)
    idx = torch.searchsorted(mids, a).clamp(max=len(mids) - 1)
    below = (a - mids[(idx - 1).clamp(min=0)]).abs()
    above = (a - mids[idx]).abs()
    return torch.minimum(below, above).reshape(v.shape)


E4M3_VALUES = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).double().sort().values
E2M1_VALUES = torch.tensor(E2M1_GRID, dtype=torch.float64)


def round_e2m1(v):
    """v already within [-6, 6] to the nearest e2m1 value, ties to the even code (code = grid index)."""
    a = v.abs()
    grid = E2M1_VALUES.to(v.dtype)
    d = (a.unsqueeze(-1) - grid).abs()
    best = d.min(dim=-1, keepdim=True).values
    # among the nearest, prefer an even index: add a penalty of 1/2 to odd indices on ties only
    tie_pen = (torch.arange(len(E2M1_GRID)) % 2).to(v.dtype) * 0.5
    cand = torch.where(d == best, tie_pen, torch.full_like(d, 2.0))
    code = cand.argmin(dim=-1)
    return torch.copysign(grid[code], v)


class Margins:
    """The smallest distance to a rounding decision seen since reset, with where it was."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.value = {"fp8": (math.inf, ""), "fp4": (math.inf, ""), "bf16": (math.inf, "")}
        self.scale = {"fp8": (math.inf, ""), "fp4": (math.inf, "")}
        self.count = {"fp8": 0, "fp4": 0, "bf16": 0}

    def note(self, table, kind, m, where):
        if m < table[kind][0]:
            table[kind] = (m, where)


MARGINS = Margins()
# data_ptr of a kv_norm output -> (where, nope): the RoPE'd result of that tensor gets the cache rounding.
MARKED = {}
# None, or the distance (relative to the block amax) within which every rounding takes its other side.
FLIP = None
# None, or (generator, 0 or 1): flip only one half of a random split of the roundings within FLIP.
FLIP_HALF = None
# None, or {(format, where): [rows of values about to be rounded]}.
RECORD = None


def other_neighbour(a, q, grid):
    """For values a (float64) rounded to q (a grid value with a's sign), the grid value bracketing |a|
    from the other side: what a value just across the midpoint between the two would round to (the
    only boundary a value FLIP-close to can sit at, FLIP being far below a quarter grid step)."""
    idx = torch.searchsorted(grid, a.abs())
    lo = grid[(idx - 1).clamp(min=0)]
    hi = grid[idx.clamp(max=len(grid) - 1)]
    other = torch.where(q.abs() == hi, lo, hi)
    return torch.copysign(other, a)


def flip_mask(rel):
    """Which roundings take their other side: within FLIP of the boundary, and in the current subset (all,
    or one half of a seeded random split: the two halves of one seed are complements)."""
    mask = rel < FLIP
    if FLIP_HALF is not None:
        gen, half = FLIP_HALF
        pick = torch.rand(rel.shape, generator=gen, dtype=torch.float64) < 0.5
        mask &= pick if half == 0 else ~pick
    return mask


def note_rows(fmt, where, x):
    """Keep the values about to be rounded (rows of the last dim) for the noise measurement."""
    if RECORD is not None:
        RECORD.setdefault((fmt, where), []).append(x.detach().double().reshape(-1, x.shape[-1]).clone())


def quantize_blocks(x, n, block, fmt, where):
    """Round x[..., :n] (float32) through fmt ('fp8' e4m3 or 'fp4' e2m1) in blocks of `block` values along
    the last dim, each with its UE8M0 scale; returns a new tensor (x[..., n:] untouched).  With FLIP set,
    every value within FLIP (relative to its block's amax) of a rounding boundary takes the grid value on
    the other side instead, and every scale within FLIP of a power of two the other power."""
    out = x.clone()
    fmax = E4M3_MAX if fmt == "fp8" else E2M1_MAX
    floor = FP8_AMAX_FLOOR if fmt == "fp8" else FP4_AMAX_FLOOR
    inv = torch.tensor(1.0 / fmax, dtype=torch.float32)
    grid = E4M3_VALUES if fmt == "fp8" else E2M1_VALUES
    note_rows(fmt, where, x[..., :n])
    for b0 in range(0, n, block):
        b1 = min(b0 + block, n)
        xb = x[..., b0:b1].float()
        amax = xb.abs().amax(dim=-1, keepdim=True).clamp_min(floor)
        r = amax * inv
        s = pow2_ceil(r)
        if FLIP is not None:
            near = flip_mask(pow2_distance(r))
            s = torch.where(near & (s == r), s * 2, torch.where(near, s / 2, s))
        v = (xb / s).clamp(-fmax, fmax)
        if fmt == "fp8":
            q = v.to(torch.float8_e4m3fn).float()
        else:
            q = round_e2m1(v)
        rel = grid_margin(v, grid) * s.double() / amax.double()
        if FLIP is not None:
            q = torch.where(flip_mask(rel), other_neighbour(v.double(), q.double(), grid).float(), q)
        out[..., b0:b1] = q * s
        if v.numel():
            MARGINS.count[fmt] += v.numel()
            MARGINS.note(MARGINS.value, fmt, float(rel.min()), where)
            MARGINS.note(MARGINS.scale, fmt, float(pow2_distance(r).min()), where)
    return out


def round_bf16(x, where):
    """x (float32) to the nearest bf16 (ties to even), noting each value's distance to the midpoints with
    its two bf16 neighbours, relative to the amax of x's last dim; with FLIP set, a value that close to a
    midpoint takes the neighbour across it."""
    note_rows("bf16", where, x)
    r = x.to(torch.bfloat16)
    bits = r.view(torch.int16)
    lo, hi = (bits - 1).view(torch.bfloat16).double(), (bits + 1).view(torch.bfloat16).double()
    rd, xd = r.double(), x.double()
    to_lo, to_hi = (xd - (rd + lo) / 2).abs(), (xd - (rd + hi) / 2).abs()
    amax = xd.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    rel = torch.minimum(to_lo, to_hi) / amax
    out = rd
    if FLIP is not None:
        out = torch.where(flip_mask(rel), torch.where(to_lo < to_hi, lo, hi), rd)
    if x.numel():
        MARGINS.count["bf16"] += x.numel()
        MARGINS.note(MARGINS.value, "bf16", float(rel.min()), where)
    return out.float()


def hadamard(n):
    """Sylvester's n x n Hadamard matrix (n a power of two), float64, entries +-1."""
    if n & (n - 1):
        raise SystemExit(f"mkfixtures_fp8: index_head_dim {n} is not a power of two")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def rotate_round(x, where):
    """Hadamard(x) / sqrt(n) over the last dim, then FP4 over all n values: the indexer's key/query path."""
    n = x.shape[-1]
    y = (x.double() @ hadamard(n)) / math.sqrt(n)
    return quantize_blocks(y.float(), n, FP4_BLOCK, "fp4", where)


def rope_then_round(x, cos, sin, *args, **kwargs):
    """transformers' apply_rotary_pos_emb, then, for a kv_norm output marked by a hook, the cache rounding:
    FP8 on the nope slice, bf16 on the RoPE slice."""
    y = TRANSFORMERS_ROPE(x, cos, sin, *args, **kwargs)
    mark = MARKED.pop(x.data_ptr(), None)
    if mark is None:
        return y
    where, nope = mark
    y = quantize_blocks(y, nope, KV_BLOCK, "fp8", where)
    y[..., nope:] = round_bf16(y[..., nope:], where)
    return y


TRANSFORMERS_ROPE = dsv4.apply_rotary_pos_emb
# The attention and compressor forwards look the function up in their module at each call.
dsv4.apply_rotary_pos_emb = rope_then_round


def install_official_numerics(model):
    """Hooks that turn transformers' exact deepseek_v4 into the official (fp8) numerics, see the module
    docstring for each place.  Returns the hook handles."""
    cfg = model.config
    nope = cfg.head_dim - cfg.qk_rope_head_dim
    handles = []

    def kv_hook(where):
        def hook(module, args, out):
            MARKED[out.data_ptr()] = (where, nope)
        return hook

    def scorer_hook(where):
        def hook(module, args):
            q, keys, hidden = args      # q [B, S, H, dI] after RoPE; keys [B, T, dI] after RoPE
            return rotate_round(q, where + " query"), rotate_round(keys, where + " key"), hidden
        return hook

    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        handles.append(attn.kv_norm.register_forward_hook(kv_hook(f"layer {i} window kv")))
        comp = attn.compressor
        if comp is None:
            continue
        handles.append(comp.kv_norm.register_forward_hook(kv_hook(f"layer {i} compressed entry")))
        if isinstance(comp, dsv4.DeepseekV4CSACompressor):
            handles.append(comp.indexer.scorer.register_forward_pre_hook(scorer_hook(f"layer {i} indexer")))
    return handles


def self_test():
    """The rounding helpers against independent statements of the formats."""
    gen = torch.Generator().manual_seed(7)
    v = (torch.rand(200000, generator=gen) * 2 - 1) * 448
    v = torch.cat([v, E4M3_VALUES.float(), ((E4M3_VALUES[1:] + E4M3_VALUES[:-1]) / 2).float()])
    v = torch.cat([v, -v])
    # nearest-even on the e4m3 grid, stated directly: the nearest grid value, on a tie the even code
    codes = torch.arange(0, 127, dtype=torch.uint8)
    vals = codes.view(torch.float8_e4m3fn).double()
    d = (v.double().abs().unsqueeze(-1) - vals).abs()
    best = d.min(dim=-1, keepdim=True).values
    pick = torch.where(d == best, (codes % 2).double(), torch.full_like(d, 2.0)).argmin(dim=-1)
    want = torch.copysign(vals[pick], v.double())
    got = v.to(torch.float8_e4m3fn).double()
    mkfixtures.check(torch.equal(got, want), "torch.float8_e4m3fn casts are not round-to-nearest-even")
    e = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 5.01, -0.75, -2.4, 6.0, 0.0])
    mkfixtures.check(round_e2m1(e).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 6.0, -1.0, -2.0, 6.0, 0.0],
                     "e2m1 rounding")
    r = torch.tensor([1.0, 1.5, 0.75, 2.0 ** -20, 3.0], dtype=torch.float32)
    mkfixtures.check(pow2_ceil(r).tolist() == [1.0, 2.0, 1.0, 2.0 ** -20, 4.0], "power-of-two ceiling")
    h = hadamard(16)
    mkfixtures.check(torch.equal(h @ h.T, 16 * torch.eye(16, dtype=torch.float64)), "Hadamard matrix")
    MARGINS.reset()


def run_forced(model, tokens, chunk, forced):
    """mkfixtures.run_case with the decode steps fed `forced` instead of the argmax: logits [P + N, V]."""
    cache = dsv4.DynamicCache(config=model.config)
    ids = torch.tensor([tokens], dtype=torch.long)
    step = len(tokens) if chunk == 0 else chunk
    rows = []
    with torch.no_grad():
        for start in range(0, len(tokens), step):
            rows.append(model(input_ids=ids[:, start:start + step], past_key_values=cache, use_cache=True).logits[0])
        for t in forced:
            rows.append(model(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True).logits[0])
    return torch.cat(rows, dim=0).float()


def row_errors(a, b):
    """Per row: max |a - b| / max |b|."""
    return (a - b).abs().max(dim=-1).values / b.abs().max(dim=-1).values


def record_noise(rec_a, rec_b):
    """Max and 99.9th percentile of |a - b| / max |a| per row, over the rounding sites the two runs saw with
    the same rows (the indexer keys are handed over whole at every call, so their sites have other shapes
    and are skipped).  Rows after a rounding that went the other way carry its consequences, not noise:
    hence the percentile."""
    diffs, sites = [], 0
    for key, rows in rec_a.items():
        if key not in rec_b:
            continue
        a, b = torch.cat(rows), torch.cat(rec_b[key])
        if a.shape != b.shape:
            continue
        sites += 1
        amax = a.abs().amax(dim=-1).clamp_min(1e-30)
        diffs.append((a - b).abs().amax(dim=-1) / amax)
    d = torch.cat(diffs)
    return float(d.max()), float(torch.quantile(d, 0.999)), sites


def load_model(fixture_dir):
    return DeepseekV4ForCausalLM.from_pretrained(fixture_dir, dtype=torch.float32, attn_implementation="eager",
                                                 experts_implementation="eager").eval()


def quantize_weight(w):
    """[out, in] float32 -> e4m3 codes, UE8M0 exponent bytes [ceil(out/128), ceil(in/128)] and the
    dequantized float32 matrix (what the oracle computes with)."""
    out, inp = w.shape
    rows, cols = -(-out // WEIGHT_BLOCK), -(-inp // WEIGHT_BLOCK)
    q = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    scale = torch.empty(rows, cols, dtype=torch.uint8)
    deq = torch.empty_like(w)
    for i in range(rows):
        for j in range(cols):
            blk = w[i * WEIGHT_BLOCK:(i + 1) * WEIGHT_BLOCK, j * WEIGHT_BLOCK:(j + 1) * WEIGHT_BLOCK]
            s = pow2_ceil(blk.abs().amax().clamp_min(FP8_AMAX_FLOOR) * torch.tensor(1.0 / E4M3_MAX))
            code = (blk / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            q[i * WEIGHT_BLOCK:(i + 1) * WEIGHT_BLOCK, j * WEIGHT_BLOCK:(j + 1) * WEIGHT_BLOCK] = code
            deq[i * WEIGHT_BLOCK:(i + 1) * WEIGHT_BLOCK, j * WEIGHT_BLOCK:(j + 1) * WEIGHT_BLOCK] = code.float() * s
            scale[i, j] = int(torch.log2(s)) + 127
    return q, scale, deq


def make_fp8_weight_fixture(base_dir, out_dir):
    """Write base_dir's model with FP8 linears (FP8_LINEARS) and bf16 floats to out_dir; return the base
    model holding exactly the stored values (dequantized) in float32."""
    model = load_model(base_dir)
    os.makedirs(out_dir, exist_ok=True)
    for stale in os.listdir(out_dir):
        os.remove(os.path.join(out_dir, stale))
    for f in ("config.json", "generation_config.json"):
        shutil.copyfile(os.path.join(base_dir, f), os.path.join(out_dir, f))
    tensors = {}
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith(FP8_LINEARS):
                q, scale, deq = quantize_weight(t.float())
                tensors[name] = q
                tensors[name[:-len("weight")] + "scale"] = scale
                t.copy_(deq)
            elif t.is_floating_point():
                tensors[name] = t.to(torch.bfloat16).contiguous()
                t.copy_(tensors[name].float())
            else:
                tensors[name] = t.contiguous()
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return model


def install_activation_quant(model):
    """Activations entering an FP8 linear (all of FP8_LINEARS but RAW_INPUT_LINEARS) rounded through e4m3
    per 1x128 along K, as the reference's linear() does before fp8_gemm."""
    def hook(where):
        def pre(module, args):
            x = args[0]
            return (quantize_blocks(x, x.shape[-1], ACT_BLOCK, "fp8", where),) + tuple(args[1:])
        return pre

    n = 0
    for mname, mod in model.named_modules():
        wname = mname + ".weight"
        if isinstance(mod, torch.nn.Linear) and wname.endswith(FP8_LINEARS) and not wname.endswith(RAW_INPUT_LINEARS):
            mod.register_forward_pre_hook(hook(mname + " input"))
            n += 1
    return n


def build(name, model, exact_cases, exact_dir, fixture_dir):
    """Run exact_cases (cases.json entries; exact logits under exact_dir) through model in the official
    numerics and write cases_fp8.json and *.fp8.f32 to fixture_dir."""
    global FLIP, FLIP_HALF, RECORD
    cfg = model.config
    install_official_numerics(model)
    probe = mkfixtures.Probe(model, cfg)

    for stale in os.listdir(fixture_dir):
        if stale.endswith(".fp8.f32") or stale == "cases_fp8.json":
            os.remove(os.path.join(fixture_dir, stale))

    summary = {"name": name, "flip_distance": FLIP_DISTANCE, "cases": []}
    cases = []
    oneshot = {}
    for ec in exact_cases:
        tokens, chunk = ec["tokens"], ec["chunk"]
        where = f"{name} {ec['name']}"
        P = len(tokens)
        MARGINS.reset()
        probe.reset()
        probe.enabled = True
        RECORD = {}
        if chunk == 0:
            logits, greedy = mkfixtures.run_case(model, tokens, chunk, DECODE)
        else:
            # decode the one-shot case's tokens, so that the rows compare one to one
            greedy = oneshot[tuple(tokens)][1]
            logits = run_forced(model, tokens, chunk, greedy)
        record, RECORD = RECORD, None
        probe.enabled = False
        margins = {f"margin_{fmt}_value": MARGINS.value[fmt][0] for fmt in MARGINS.value}
        margins.update({f"margin_{fmt}_scale": MARGINS.scale[fmt][0] for fmt in MARGINS.scale})
        margins.update({f"rounded_{fmt}": MARGINS.count[fmt] for fmt in MARGINS.count})
        # Selections decided by gaps this small could also go the other way on float noise alone.
        mkfixtures.check(probe.router_gap > MIN_SELECTION_GAP and probe.index_gap > MIN_SELECTION_GAP,
                         f"{where}: MoE or indexer top-k near tie ({probe.router_gap:.2e}, {probe.index_gap:.2e})")
        mkfixtures.check(not MARKED, f"{where}: a kv_norm output never reached RoPE: {MARKED}")
        mkfixtures.check(torch.isfinite(logits).all(), f"{where}: non-finite fp8 logits")
        mkfixtures.check(torch.equal(logits, run_forced(model, tokens, chunk, greedy)), f"{where}: two runs differ")

        # Every rounding within FLIP_DISTANCE of its boundary taken to the other side at once: how far the
        # logits can move when another float32 implementation rounds those values the other way.
        # Also each half of a random split, so that effects cancelling in the whole set still show.
        FLIP = FLIP_DISTANCE
        sensitivity = row_errors(run_forced(model, tokens, chunk, greedy), logits)
        for half in (0, 1):
            FLIP_HALF = (torch.Generator().manual_seed(FLIP_SEED), half)
            sensitivity = torch.maximum(sensitivity, row_errors(run_forced(model, tokens, chunk, greedy), logits))
        FLIP, FLIP_HALF = None, None
        tol = torch.clamp(FLIP_SAFETY * sensitivity, min=BASE_TOLERANCE)

        gaps = [mkfixtures.logit_gap(logits[r]) for r in range(logits.shape[0])]
        min_gap = min(gaps[P - 1:])
        mkfixtures.check(min_gap > mkfixtures.MIN_LOGIT_GAP_REL, f"{where}: greedy argmax near tie ({min_gap:.2e})")
        info = {"case": ec["name"], "min_greedy_gap": min_gap, "router_gap": probe.router_gap,
                "index_gap": probe.index_gap, "index_dropping_rows": probe.index_dropping_rows, **margins,
                "flip_sensitivity_max": float(sensitivity.max()),
                "rows_above_base_tolerance": int((tol > BASE_TOLERANCE).sum()),
                "greedy_steps_decided": sum(gaps[P - 1 + j] > 2 * float(tol[P - 1 + j]) for j in range(DECODE)),
                "greedy": greedy}
        exact = torch.from_numpy(mkfixtures.np.fromfile(os.path.join(exact_dir, ec["logits"]), dtype="<f4"))
        exact = exact.reshape(ec["rows"], ec["vocab"])
        info["vs_exact_prompt_rows"] = mkfixtures.row_error(logits[:P], exact[:P])
        info["greedy_agreement_with_exact"] = sum(a == b for a, b in zip(greedy, ec["greedy"]))
        if chunk == 0:
            oneshot[tuple(tokens)] = (logits, greedy, tol, record)
            full = torch.tensor([tokens + greedy[:-1]])
            with torch.no_grad():
                ref = model(input_ids=full, use_cache=False).logits[0].float()
            err = row_errors(logits[:-1], ref)
            info["nocache_err"] = float(err.max())
            bad = (err > tol[:-1]).nonzero()
            mkfixtures.check(not len(bad), f"{where}: cached vs cache-free row {bad[:1].tolist()} differs by "
                             f"{info['nocache_err']:.2e}")
        else:
            base, base_greedy, base_tol, base_record = oneshot[tuple(tokens)]
            err = row_errors(logits, base)
            info["vs_oneshot"] = float(err.max())
            # reported, not checked: after a rounding that flipped between the two runs it measures the
            # consequences of that flip rather than rounding-order noise
            info["noise_max"], info["noise_p999"], info["noise_sites"] = record_noise(base_record, record)
            bound = torch.maximum(tol, base_tol)
            bad = (err > bound).nonzero()
            mkfixtures.check(not len(bad), f"{where}: chunked vs one-shot differ ({info['vs_oneshot']:.2e}, rows "
                             f"{bad[:4].tolist()})")
            for j in range(DECODE):
                r = P - 1 + j
                if gaps[r] > 2 * float(bound[r]):
                    mkfixtures.check(int(logits[r].argmax()) == greedy[j], f"{where}: decided greedy step {j} differs")
        summary["cases"].append(info)

        fname = ec["name"] + ".fp8.f32"
        logits.numpy().astype("<f4").tofile(os.path.join(fixture_dir, fname))
        cases.append({"name": ec["name"], "tokens": tokens, "chunk": chunk, "decode": DECODE, "logits": fname,
                      "rows": int(logits.shape[0]), "vocab": cfg.vocab_size, "greedy": greedy,
                      "row_tolerance": [float(f"{t:.3g}") for t in tol.tolist()]})

    with open(os.path.join(fixture_dir, "cases_fp8.json"), "w") as f:
        json.dump(cases, f, indent=1)
        f.write("\n")
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fixtures", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures"))
    parser.add_argument("--only", action="append", help="only this model (repeatable)")
    parser.add_argument("--fp8-weights", metavar="DIR",
                        help=f"also write {FP8_WEIGHT_BASE} with FP8 linears and its oracle to DIR (outside tests/fixtures)")
    args = parser.parse_args()
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    if (major, minor) < (5, 8):
        raise SystemExit(f"mkfixtures_fp8: transformers >= 5.8 needed, found {transformers.__version__}")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    self_test()
    for name in sorted(os.listdir(args.fixtures)):
        d = os.path.join(args.fixtures, name)
        if not os.path.isfile(os.path.join(d, "cases.json")) or (args.only and name not in args.only):
            continue
        with open(os.path.join(d, "cases.json")) as f:
            exact_cases = json.load(f)
        json.dump(build(name, load_model(d), exact_cases, d, d), sys.stdout, indent=1)
        sys.stdout.write("\n")
    if args.fp8_weights:
        base, out = os.path.join(args.fixtures, FP8_WEIGHT_BASE), args.fp8_weights
        model = make_fp8_weight_fixture(base, out)
        mkfixtures.check(install_activation_quant(model) > 0, f"{out}: no FP8 linear found")
        with open(os.path.join(base, "cases.json")) as f:
            exact_cases = [c for c in json.load(f) if c["name"] in FP8_WEIGHT_CASES]
        json.dump(build(os.path.basename(os.path.normpath(out)), model, exact_cases, base, out), sys.stdout, indent=1)
        sys.stdout.write("\n")

if __name__ == "__main__":
    main()
