# SPDX-License-Identifier: MIT
"""The DeepSeek-V4 MTP block in PyTorch, over transformers' deepseek_v4 modules (transformers builds none).

Used by tools/mkfixtures_mtp.py (the oracle the engine's MTP block is checked against) and by
tools/train_default.py --train-mtp. doc/MODEL.md §3.9: for the main model's final streams X_p [hc, D]
at position p (the input of the model's hc_head) and the token t_{p+1},

    e       = RMSNorm_enorm(embed[t_{p+1}])
    X_in[j] = e_proj e + h_proj RMSNorm_hnorm(X_p[j])            for every stream j
    X_out   = DeepseekV4DecoderLayer (a sliding-window layer with scored MoE) on X_in at position p,
              attending over the block's own keys of positions p - window + 1 .. p
    logits  = lm_head(RMSNorm_norm(DeepseekV4HyperHead(X_out)))     (the block's hc_head and norm)

Checkpoint names: the layer in transformers' module spelling under `model.mtp.0.` (as the main layers
under `model.layers.i.`), the block's own parts under DeepSeek's names: `model.mtp.0.{enorm,hnorm,e_proj,
h_proj,norm}.weight`, `model.mtp.0.hc_head_{fn,base,scale}`.
"""

import copy

from torch import nn
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as dsv4


def mtp_config(cfg):
    """The block's layer: one sliding-window layer with scored routing, otherwise the model's config."""
    c = copy.deepcopy(cfg)
    c.num_hidden_layers = 1
    c.layer_types = ["sliding_attention"]
    c.mlp_layer_types = ["moe"]
    return c


class MTPBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        D = cfg.hidden_size
        self.cfg = mtp_config(cfg)
        self.enorm = dsv4.DeepseekV4RMSNorm(D, eps=cfg.rms_norm_eps)
        self.hnorm = dsv4.DeepseekV4RMSNorm(D, eps=cfg.rms_norm_eps)
        self.e_proj = nn.Linear(D, D, bias=False)
        self.h_proj = nn.Linear(D, D, bias=False)
        self.layer = dsv4.DeepseekV4DecoderLayer(self.cfg, 0)
        self.hc_head = dsv4.DeepseekV4HyperHead(cfg)
        self.norm = dsv4.DeepseekV4RMSNorm(D, eps=cfg.rms_norm_eps)

    def forward(self, model, streams, next_ids, position_ids, cache=None):
        """streams [B, S, hc, D] (main model, positions position_ids), next_ids [B, S]: logits [B, S, V]."""
        e = self.e_proj(self.enorm(model.model.embed_tokens(next_ids)))
        x = self.h_proj(self.hnorm(streams)) + e.unsqueeze(2)
        rotary = model.model.rotary_emb
        pe = {"main": rotary(e, position_ids=position_ids, layer_type="main"),
              "compress": rotary(e, position_ids=position_ids, layer_type="compress")}
        mask = create_sliding_window_causal_mask(config=self.cfg, inputs_embeds=e, attention_mask=None,
                                                 past_key_values=cache, position_ids=position_ids)
        x = self.layer(x, position_embeddings=pe, position_ids=position_ids, attention_mask=mask,
                       input_ids=next_ids, past_key_values=cache)
        return model.lm_head(self.norm(self.hc_head(x)))

    def release_state(self):
        """The block's tensors under the checkpoint names the engine reads."""
        out = {}
        for k, v in self.state_dict().items():
            if k.startswith("layer."):
                name = "model.mtp.0." + k[len("layer."):]
            elif k.startswith("hc_head.hc_"):
                name = "model.mtp.0.hc_head_" + k[len("hc_head.hc_"):]
            else:
                name = "model.mtp.0." + k
            out[name] = v.detach().contiguous()
        return out


def main_streams_hook(model, store):
    """Record the main model's final streams (its hc_head's input) into store["x"] on each forward."""
    return model.model.hc_head.register_forward_pre_hook(lambda m, args: store.__setitem__("x", args[0]))
