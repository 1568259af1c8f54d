#!/usr/bin/env python3
"""Build the oracle for the `fp8` ("official") numerics of the tiny DeepSeek-V4 fixtures.

For every tests/fixtures/<model>/ made by tools/mkfixtures.py this loads the model with transformers'
deepseek_v4 (float32, eager attention and experts, CPU), wraps its modules with hooks that round the
caches the way DeepSeek's reference inference code does (SPEC.md sections 2-5), and runs the prompts of
cases.json again: one-shot and chunked prefill, then greedy decode on the fp8 model's own argmax.  It
writes cases_fp8.json (the cases.json format) and <case>.fp8.f32 logits beside the exact ones.

Where each rounding happens (DeepSeek's V4 inference model.py, the Attention / Compressor / Indexer
forwards, and its kernel.py quantizers), and how it is reproduced here:
  * window KV: kv = kv_norm(wkv x), RoPE on the last rope_dim values, then the first head_dim - rope_dim
    ("nope") values are rounded in place through FP8 e4m3 in blocks of 64 with a UE8M0 scale; the rounded
    vector is what the window ring stores, what the token itself attends to, and the value too (K = V).
    The RoPE slice is rounded to bf16: the reference keeps it in BF16 ("for positional precision", its
    whole model runs in BF16) and the cache entry of SPEC section 5 stores it as 64 bf16 values; this
    numerics is "the caches as the official layout stores them" (SPEC section 4), everything else f32.
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
    dequantized cache), and neither are the RoPE dims of the cache (kept in BF16 "for positional
    precision").
  * activations entering a linear are quantized (1x128 e4m3, UE8M0) only when that linear's weight is
    FP8 or FP4 (the reference's linear() dispatches on the weight dtype; a BF16/F32 weight takes a plain
    matmul).  The fixtures' weights are all F32, so no activation is quantized here.
  * UE8M0 scales, as kernel.py computes them: FP8 s = 2^ceil(log2(max(amax, 1e-4) * f32(1/448)));
    FP4 s = 2^ceil(log2(max(amax, 6 * 2^-126) * f32(1/6))); values are x / s clamped to the format's
    maximum, rounded to nearest even.  A block shorter than its nominal size (the tiny models' nope slice
    is 24 or 48 values, the index heads 16 or 32) takes its own scale over the values it has.
FP8 rounding uses torch.float8_e4m3fn casts (checked against an explicit nearest-even grid rounding);
FP4 rounds explicitly to the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}; the Hadamard matrix is Sylvester's,
applied in float64.

Everything else is transformers' float32 computation, the "exact" numerics of the fixtures.

Two implementations computing the same float32 values up to rounding order (~1e-7 relative) make the
same FP8/FP4 choice unless a value lies that close to a rounding boundary.  The script measures, per case,
the smallest distance of any rounded value to its boundary (relative to its block's amax) and of any
block scale to a power of two, and refuses cases that come within MIN_ROUND_MARGIN; it also requires the
chunked runs to give the one-shot logits and greedy tokens, and the cached decode to agree with one
cache-free forward: both compare float32 computations that differ only in rounding order, exactly the
situation of the C backend against this oracle.

Usage: python3 tools/mkfixtures_fp8.py [--fixtures tests/fixtures] [--only tiny_a]
"""

import argparse
import json
import math
import os
import sys

import torch
import transformers
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
# Greedy decode steps after each prompt (as many as the exact fixtures).
DECODE = 16
# Smallest admitted distance of a rounded value to its rounding boundary, relative to its block's amax,
# and of a block scale's amax/max to a power of two: 100x the float32 rounding-order noise between two
# implementations of the same forward (chunked vs one-shot here measures 1e-6 at the logits).
MIN_ROUND_MARGIN = 1e-5
ROW_TOLERANCE = mkfixtures.ROW_TOLERANCE


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
# data_ptr of a kv_norm output -> where: the RoPE'd result of that tensor gets the cache rounding.
MARKED = {}


def quantize_blocks(x, n, block, fmt, where):
    """Round x[..., :n] (float32) through fmt ('fp8' e4m3 or 'fp4' e2m1) in blocks of `block` values along
    the last dim, each with its UE8M0 scale; returns a new tensor (x[..., n:] untouched)."""
    out = x.clone()
    fmax = E4M3_MAX if fmt == "fp8" else E2M1_MAX
    floor = FP8_AMAX_FLOOR if fmt == "fp8" else FP4_AMAX_FLOOR
    inv = torch.tensor(1.0 / fmax, dtype=torch.float32)
    grid = E4M3_VALUES if fmt == "fp8" else E2M1_VALUES
    for b0 in range(0, n, block):
        b1 = min(b0 + block, n)
        xb = x[..., b0:b1].float()
        amax = xb.abs().amax(dim=-1, keepdim=True).clamp_min(floor)
        r = amax * inv
        s = pow2_ceil(r)
        v = (xb / s).clamp(-fmax, fmax)
        if fmt == "fp8":
            q = v.to(torch.float8_e4m3fn).float()
        else:
            q = round_e2m1(v)
        out[..., b0:b1] = q * s
        if v.numel():
            MARGINS.count[fmt] += v.numel()
            rel = grid_margin(v, grid) * s.double() / amax.double()
            MARGINS.note(MARGINS.value, fmt, float(rel.min()), where)
            MARGINS.note(MARGINS.scale, fmt, float(pow2_distance(r).min()), where)
    return out


def round_bf16(x, where):
    """x (float32) to the nearest bf16 (ties to even), noting each value's distance to the midpoints with
    its two bf16 neighbours, relative to the amax of x's last dim."""
    r = x.to(torch.bfloat16)
    bits = r.view(torch.int16)
    lo, hi = (bits - 1).view(torch.bfloat16).double(), (bits + 1).view(torch.bfloat16).double()
    rd, xd = r.double(), x.double()
    dist = torch.minimum((xd - (rd + lo) / 2).abs(), (xd - (rd + hi) / 2).abs())
    amax = xd.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    if x.numel():
        MARGINS.count["bf16"] += x.numel()
        MARGINS.note(MARGINS.value, "bf16", float((dist / amax).min()), where)
    return r.float()


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


def install_official_numerics(model):
    """Hooks that turn transformers' exact deepseek_v4 into the official (fp8) numerics, see the module
    docstring for each place.  Returns the hook handles."""
    cfg = model.config
    nope = cfg.head_dim - cfg.qk_rope_head_dim
    handles = []

    marked = MARKED
    rope = dsv4.apply_rotary_pos_emb

    def kv_hook(where):
        def hook(module, args, out):
            marked[out.data_ptr()] = where
        return hook

    def rope_then_round(x, cos, sin, *args, **kwargs):
        y = rope(x, cos, sin, *args, **kwargs)
        where = marked.pop(x.data_ptr(), None)
        if where is None:
            return y
        y = quantize_blocks(y, nope, KV_BLOCK, "fp8", where)
        y[..., nope:] = round_bf16(y[..., nope:], where)
        return y

    dsv4.apply_rotary_pos_emb = rope_then_round

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


def build(fixture_dir):
    name = os.path.basename(os.path.normpath(fixture_dir))
    with open(os.path.join(fixture_dir, "cases.json")) as f:
        exact_cases = json.load(f)
    model = DeepseekV4ForCausalLM.from_pretrained(fixture_dir, dtype=torch.float32, attn_implementation="eager",
                                                  experts_implementation="eager").eval()
    cfg = model.config
    install_official_numerics(model)
    probe = mkfixtures.Probe(model, cfg)

    for stale in os.listdir(fixture_dir):
        if stale.endswith(".fp8.f32") or stale == "cases_fp8.json":
            os.remove(os.path.join(fixture_dir, stale))

    summary = {"name": name, "cases": []}
    cases = []
    oneshot = {}
    for ec in exact_cases:
        tokens, chunk = ec["tokens"], ec["chunk"]
        key = tuple(tokens)
        MARGINS.reset()
        probe.reset()
        probe.enabled = True
        logits, greedy = mkfixtures.run_case(model, tokens, chunk, DECODE)
        probe.enabled = False
        mkfixtures.check(not MARKED, f"{name} {ec['name']}: a kv_norm output never reached RoPE: {MARKED}")
        mkfixtures.check(torch.isfinite(logits).all(), f"{name} {ec['name']}: non-finite fp8 logits")
        again, greedy_again = mkfixtures.run_case(model, tokens, chunk, DECODE)
        mkfixtures.check(torch.equal(logits, again) and greedy == greedy_again, f"{name} {ec['name']}: two runs differ")

        where = f"{name} {ec['name']}"
        for table, what in ((MARGINS.value, "value"), (MARGINS.scale, "scale")):
            for fmt, (m, at) in table.items():
                mkfixtures.check(m >= MIN_ROUND_MARGIN, f"{where}: {fmt} {what} within {m:.1e} of a rounding "
                                 f"boundary ({at})")
        P = len(tokens)
        min_gap = min(mkfixtures.logit_gap(logits[r]) for r in range(P - 1, logits.shape[0]))
        mkfixtures.check(min_gap > mkfixtures.MIN_LOGIT_GAP_REL, f"{where}: greedy argmax near tie ({min_gap:.2e})")
        mkfixtures.check(probe.router_gap > mkfixtures.MIN_ROUTER_GAP,
                         f"{where}: MoE top-k near tie ({probe.router_gap:.2e})")
        mkfixtures.check(probe.index_gap > mkfixtures.MIN_INDEX_GAP_REL,
                         f"{where}: indexer top-k near tie ({probe.index_gap:.2e})")

        info = {"case": ec["name"], "min_greedy_gap": min_gap, "router_gap": probe.router_gap,
                "index_gap": probe.index_gap, "index_dropping_rows": probe.index_dropping_rows,
                "margin_fp8_value": MARGINS.value["fp8"][0], "margin_fp8_scale": MARGINS.scale["fp8"][0],
                "margin_fp4_value": MARGINS.value["fp4"][0], "margin_fp4_scale": MARGINS.scale["fp4"][0],
                "margin_bf16_value": MARGINS.value["bf16"][0], "rounded_fp8": MARGINS.count["fp8"],
                "rounded_fp4": MARGINS.count["fp4"], "rounded_bf16": MARGINS.count["bf16"], "greedy": greedy}
        exact = torch.from_numpy(mkfixtures.np.fromfile(os.path.join(fixture_dir, ec["logits"]), dtype="<f4"))
        exact = exact.reshape(ec["rows"], ec["vocab"])
        info["vs_exact_prompt_rows"] = mkfixtures.row_error(logits[:P], exact[:P])
        info["greedy_agreement_with_exact"] = sum(a == b for a, b in zip(greedy, ec["greedy"]))
        if chunk == 0:
            oneshot[key] = (logits, greedy)
            full = torch.tensor([tokens + greedy[:-1]])
            with torch.no_grad():
                ref = model(input_ids=full, use_cache=False).logits[0].float()
            info["nocache_err"] = mkfixtures.row_error(logits[:-1], ref)
            mkfixtures.check(info["nocache_err"] <= ROW_TOLERANCE,
                             f"{where}: cached vs cache-free rows differ ({info['nocache_err']:.2e})")
        else:
            base, base_greedy = oneshot[key]
            info["vs_oneshot"] = mkfixtures.row_error(logits, base)
            mkfixtures.check(info["vs_oneshot"] <= ROW_TOLERANCE and greedy == base_greedy,
                             f"{where}: chunked vs one-shot differ ({info['vs_oneshot']:.2e})")
        summary["cases"].append(info)

        fname = ec["name"] + ".fp8.f32"
        logits.numpy().astype("<f4").tofile(os.path.join(fixture_dir, fname))
        cases.append({"name": ec["name"], "tokens": tokens, "chunk": chunk, "decode": DECODE, "logits": fname,
                      "rows": int(logits.shape[0]), "vocab": cfg.vocab_size, "greedy": greedy})

    with open(os.path.join(fixture_dir, "cases_fp8.json"), "w") as f:
        json.dump(cases, f, indent=1)
        f.write("\n")
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fixtures", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures"))
    parser.add_argument("--only", action="append", help="only this model (repeatable)")
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
        json.dump(build(d), sys.stdout, indent=1)
        sys.stdout.write("\n")


if __name__ == "__main__":
    main()
