"""A query's MiniLM forward without the module machinery: the same weights, the same ops.

A search embeds one short question (~11 tokens). Through sentence-transformers and
transformers' BertModel that costs ~14 ms on one core of a 2-core Zen 4 in fp32, of which
~4 ms is Python: ~120 module calls, output dataclasses, feature dicts, `eval()` walking the
modules on every call. This runs the same forward as ~40 tensor ops: the embeddings and
their LayerNorm, then per layer one fused QKV projection (the three weights concatenated
once), SDPA, the output projection with its residual and LayerNorm, the GELU feed-forward
with its residual and LayerNorm; mean pooling and L2 normalisation last (Zen 4 VM,
2026-11-28: 14.0 -> 10.0 ms a question; the vectors within 1.1e-7 of `encode`'s).

One text at a time, unpadded, so no attention mask is needed: the quick lane's calls
(`embed.Embedder`). `LeanBert.of` takes only the shape it knows (a BERT encoder with absolute
positions and erf GELU, mean pooling, optional Normalize) and `check` compares it with the
model's own `encode` on fixed texts when the embedder loads: a model or library version that
differs is refused (logged) and the queries go through `encode` as before.
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)

CHECK_TEXTS = ("warm up", "When did Tom move house?", "Which instrument did Priya pick up??",
               "ok", "We got the keys to the new flat last Tuesday - finally!! 🎉 " * 3)


class LeanBert:
    """texts -> normalised [N, dim] float32, one unpadded forward per text."""

    def __init__(self, st_model):
        import torch

        first, bert = st_model[0], st_model[0].auto_model
        self.tokenizer = first.tokenizer
        self.max_length = int(first.max_seq_length)
        emb = bert.embeddings
        self.word, self.pos = emb.word_embeddings.weight, emb.position_embeddings.weight
        self.type0 = emb.token_type_embeddings.weight[0]
        self.ln0 = (emb.LayerNorm.weight, emb.LayerNorm.bias)
        self.eps = float(bert.config.layer_norm_eps)
        self.heads = int(bert.config.num_attention_heads)
        self.layers = []
        with torch.no_grad():
            for layer in bert.encoder.layer:
                att = layer.attention
                qkv = (att.self.query, att.self.key, att.self.value)
                self.layers.append((
                    torch.cat([p.weight for p in qkv]).contiguous(), torch.cat([p.bias for p in qkv]),
                    att.output.dense.weight, att.output.dense.bias, att.output.LayerNorm.weight, att.output.LayerNorm.bias,
                    layer.intermediate.dense.weight, layer.intermediate.dense.bias,
                    layer.output.dense.weight, layer.output.dense.bias, layer.output.LayerNorm.weight,
                    layer.output.LayerNorm.bias))
        # the layer's three kinds of product: x W^T + b, gelu(x W^T + b) and x W^T + b + r. In bf16
        # where oneDNN multiplies it natively, the four weights of a layer are packed once for it
        # and the GELU and the residual add are its post-ops (one rounding each instead of two):
        # F.linear on an unpacked bf16 weight reorders it at every call (one thread, 12 rows x
        # 384 -> 1,536: 138 us against 84 packed, AMX Xeon VM)
        import torch.nn.functional as F

        from ..engine.linear import onednn_bf16

        if self.word.dtype == torch.bfloat16 and onednn_bf16():
            pack, lin = torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise
            self.layers = [(pack(wqkv, 1), bqkv, pack(wo, 1), bo, g1, b1, pack(wi, 1), bi, pack(wo2, 1), bo2, g2, b2)
                           for wqkv, bqkv, wo, bo, g1, b1, wi, bi, wo2, bo2, g2, b2 in self.layers]
            self.dense = lambda x, w, b: lin(x, w, b, "none", [], "")
            self.dense_gelu = lambda x, w, b: lin(x, w, b, "gelu", [], "none")
            self.dense_add = lambda x, r, w, b: lin.binary(x, r, w, b, "add")
        else:
            self.dense = F.linear
            self.dense_gelu = lambda x, w, b: F.gelu(F.linear(x, w, b))
            self.dense_add = lambda x, r, w, b: F.linear(x, w, b) + r

    @classmethod
    def of(cls, st_model) -> LeanBert | None:
        """A LeanBert for `st_model` where its layout is the one this forward computes, else None."""
        try:
            modules = list(st_model)
            bert = modules[0].auto_model
            cfg = bert.config
            pool = modules[1]
            ok = (type(bert).__name__ == "BertModel" and cfg.hidden_act == "gelu"
                  and getattr(cfg, "position_embedding_type", "absolute") == "absolute"
                  and type(pool).__name__ == "Pooling" and getattr(pool, "pooling_mode", None) == "mean"
                  and all(type(m).__name__ == "Normalize" for m in modules[2:])
                  and not getattr(modules[0], "do_lower_case", False) and hasattr(modules[0], "tokenizer"))
        except (AttributeError, IndexError, TypeError):
            return None
        return cls(st_model) if ok else None

    def __call__(self, texts: list[str]) -> np.ndarray:
        import torch

        with torch.inference_mode():
            return np.stack([self._one(t).float().numpy() for t in texts])

    def _one(self, text: str):
        import torch
        import torch.nn.functional as F

        ids = torch.tensor(self.tokenizer(text, truncation=True, max_length=self.max_length)["input_ids"])
        n = len(ids)
        h = self.word[ids] + self.pos[:n] + self.type0
        d = h.shape[-1]
        h = F.layer_norm(h, (d,), *self.ln0, self.eps)
        hd = d // self.heads
        for wqkv, bqkv, wo, bo, g1, b1, wi, bi, wo2, bo2, g2, b2 in self.layers:
            qkv = self.dense(h, wqkv, bqkv).view(n, 3, self.heads, hd).permute(1, 2, 0, 3)
            a = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2]).transpose(0, 1).reshape(n, d)
            h = F.layer_norm(self.dense_add(a, h, wo, bo), (d,), g1, b1, self.eps)
            h = F.layer_norm(self.dense_add(self.dense_gelu(h, wi, bi), h, wo2, bo2), (d,), g2, b2, self.eps)
        return F.normalize(h.mean(0), dim=0)

    def check(self, encode, tolerance: float) -> bool:
        """Whether this forward gives `encode`'s vectors on CHECK_TEXTS (cosine within
        `tolerance` of 1 for each)."""
        try:
            got = self(list(CHECK_TEXTS))
        except Exception as e:  # noqa: BLE001 - any failure means: use the model's own path
            log.warning("lean query forward failed its check (%s); queries use sentence-transformers", e)
            return False
        want = encode(list(CHECK_TEXTS))
        worst = float((got * want).sum(axis=1).min())
        if worst < 1 - tolerance:
            log.warning("lean query forward differs from sentence-transformers (cosine %.6f); not used", worst)
            return False
        return True
