"""Chunk KV as bytes: raw, or quantized to int8 / int4 in groups with scales (`AGENTMEM_KV_CODEC`).

K and V differ in where their outliers sit (KIVI, CacheGen): K has a few channels of large
magnitude shared by every token, V does not. So K is quantized per channel (one scale and
minimum per channel per group of `K_GROUP` tokens) and V per token (one per token per group
of `V_GROUP` channels), both asymmetric (min/max), with fp16 scales. int4 packs two values a
byte. At groups of 32 that is 0.625 bytes an element against bf16's 2 (0.31x) for int4, and
1.125 (0.56x) for int8.

Entropy coding (zlib on the quantized payload) is kept for a blob only where it comes out at
most `ENTROPY_KEEP` of its size: int4 codes of KV are close to uniform inside each group,
so it rarely pays, and decoding it costs time on every load (docs/kvreuse.md has the figures).

A blob is a magic line, a JSON header (key, namespace, context, dtype, shapes, codec, group
sizes, whether entropy coded, payload length, blake2b digest of the payload) and the
payload. `decode` checks the digest before anything else is read: a torn or corrupt blob is
rejected (None), never decoded into wrong KV. Files of the earlier raw-only format still read.
"""

from __future__ import annotations

import hashlib
import json
import zlib

import torch

from .entry import ChunkKV

CODECS = ("raw", "int8", "int4")
K_GROUP = 32  # at most this many tokens per K scale (per channel); see k_group
V_GROUP = 32  # channels per V scale (per token)
ENTROPY_KEEP = 0.9  # keep the zlib'd payload only when it is at most this share of the plain one
_MAGIC = b"AMKV2\n"
_MAGIC_RAW1 = b"AMKV1\n"
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16)}
_BITS = {"int8": 8, "int4": 4}


def check_codec(codec: str) -> str:
    if codec not in CODECS:
        raise ValueError(f"kv_codec must be one of {CODECS}, got {codec!r}")
    return codec


def _quantize(x: torch.Tensor, bits: int, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x grouped along `dim` -> codes uint8 (x's shape), scale and min fp16 (x's shape without
    `dim`): x ~= codes * scale + min, |error| <= scale / 2 (plus the fp16 rounding of scale and
    min). One min/max pass and the arithmetic in place on one fp32 copy."""
    qmax = (1 << bits) - 1
    x = x.to(torch.float32, copy=True)  # a copy always: fp32 input must not be overwritten in place
    lo, hi = torch.aminmax(x, dim=dim)
    scale = ((hi - lo) / qmax).to(torch.float16)
    lo16 = lo.to(torch.float16)
    inv = 1.0 / scale.float().clamp_min(torch.finfo(torch.float16).tiny)
    x.sub_(lo16.float().unsqueeze(dim)).mul_(inv.unsqueeze(dim)).round_().clamp_(0, qmax)
    return x.to(torch.uint8), scale, lo16


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, dtype: torch.dtype,
                dim: int = -1) -> torch.Tensor:
    return torch.addcmul(lo.float().unsqueeze(dim), codes.float(), scale.float().unsqueeze(dim)).to(dtype)


def _k_groups(k: torch.Tensor, g: int) -> torch.Tensor:
    """K [L, T, KV, hd] -> [L, KV, hd, T/g, g]: each channel's tokens in groups of g (the last
    group padded with the last token, which leaves its min and max as they are). The layout of
    the first codec version (`k_layout` absent); `_k_token_groups` is the one written now."""
    layers, t, kvh, hd = k.shape
    pad = -t % g
    if pad:
        k = torch.cat([k, k[:, -1:].expand(layers, pad, kvh, hd)], 1)
    return k.permute(0, 2, 3, 1).reshape(layers, kvh, hd, -1, g)


def _k_token_groups(k: torch.Tensor, g: int) -> torch.Tensor:
    """K [L, T, KV, hd] -> [L, T/g, g, KV, hd]: the same groups as `_k_groups` (each channel's
    tokens, g at a time) in token order, so that neither encode nor decode permutes."""
    layers, t, kvh, hd = k.shape
    pad = -t % g
    if pad:
        k = torch.cat([k, k[:, -1:].expand(layers, pad, kvh, hd)], 1)
    return k.view(layers, -1, g, kvh, hd)


def k_group(tokens: int) -> int:
    """Tokens per K group: at most K_GROUP, as even as can be, so that a 40-token memory line
    takes two groups of 20 rather than one of 32 and one padded with 24 copies."""
    n = max(1, -(-tokens // K_GROUP))
    return -(-tokens // n)


def _v_group(hd: int) -> int:
    return V_GROUP if hd % V_GROUP == 0 else hd


def _pack4(codes: torch.Tensor) -> torch.Tensor:
    flat = codes.reshape(-1)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    pairs = flat.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _unpack4(packed: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.stack([packed & 0x0F, packed >> 4], 1).reshape(-1)
    return out[:n]


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def encode(key: str, namespace: str, kv: ChunkKV, codec: str = "raw", entropy: bool = True) -> bytes:
    """An entry as a blob (see the module docstring). `entropy=False` never tries zlib."""
    check_codec(codec)
    k = kv.k.detach().cpu()
    v = kv.v.detach().cpu()
    layers, t, kvh, hd = k.shape
    head = {"key": key, "namespace": namespace, "context": kv.context, "dtype": str(k.dtype),
            "k_shape": list(k.shape), "v_shape": list(v.shape), "codec": codec}
    if codec == "raw":
        parts = [_bytes(k), _bytes(v)]
    else:
        bits = _BITS[codec]
        kg, vg = k_group(t), _v_group(hd)
        kc, ks, kl = _quantize(_k_token_groups(k, kg), bits, dim=2)
        vc, vs, vl = _quantize(v.reshape(layers, t, kvh, hd // vg, vg), bits)
        if bits == 4:
            kc, vc = _pack4(kc), _pack4(vc)
        head |= {"k_group": kg, "v_group": vg, "k_layout": "tokens"}
        parts = [_bytes(x) for x in (kc, ks, kl, vc, vs, vl)]
        head["sizes"] = [len(p) for p in parts]
    payload = b"".join(parts)
    head["entropy"] = False
    if entropy and codec != "raw":
        packed = zlib.compress(payload, 1)
        if len(packed) <= ENTROPY_KEEP * len(payload):
            payload, head["entropy"] = packed, True
    head["payload"] = len(payload)
    head["digest"] = hashlib.blake2b(payload, digest_size=16).hexdigest()
    header = json.dumps(head).encode()
    return _MAGIC + len(header).to_bytes(4, "little") + header + payload


def decode(data: bytes, key: str) -> tuple[str, ChunkKV] | None:
    """`encode`'s inverse: (namespace, entry), or None when the bytes are not an intact entry
    for `key` (wrong magic, key, length or digest; a header or payload that does not parse)."""
    try:
        return _decode(data, key)
    except (ValueError, KeyError, RuntimeError, TypeError, IndexError, zlib.error):
        return None


def codec_of(data: bytes) -> str | None:
    """The codec a blob was written with (None: not a blob)."""
    if data.startswith(_MAGIC_RAW1):
        return "raw"
    if not data.startswith(_MAGIC) or len(data) < len(_MAGIC) + 4:
        return None
    n = int.from_bytes(data[len(_MAGIC) : len(_MAGIC) + 4], "little")
    try:
        return json.loads(data[len(_MAGIC) + 4 : len(_MAGIC) + 4 + n]).get("codec")
    except ValueError:
        return None


def layout(data: bytes) -> dict[str, int]:
    """Where a blob's bytes go: header (magic, length, JSON), and for a quantized blob the
    codes and the scales with minimums of K and V (`bench kvstore` reports their shares)."""
    n = int.from_bytes(data[len(_MAGIC) : len(_MAGIC) + 4], "little")
    head = json.loads(data[len(_MAGIC) + 4 : len(_MAGIC) + 4 + n])
    out = {"header": len(_MAGIC) + 4 + n}
    if head.get("codec", "raw") == "raw" or head.get("entropy"):
        return out | {"payload": head["payload"]}
    kc, ks, kl, vc, vs, vl = head["sizes"]
    return out | {"k_codes": kc, "k_scales": ks + kl, "v_codes": vc, "v_scales": vs + vl}


def _decode(data: bytes, key: str) -> tuple[str, ChunkKV] | None:
    magic = data[: len(_MAGIC)]
    if magic not in (_MAGIC, _MAGIC_RAW1) or len(data) < len(_MAGIC) + 4:
        return None
    n = int.from_bytes(data[len(_MAGIC) : len(_MAGIC) + 4], "little")
    start = len(_MAGIC) + 4 + n
    head = json.loads(data[len(_MAGIC) + 4 : start])
    payload = data[start:]
    if head["key"] != key or len(payload) != head["payload"] or head["dtype"] not in _DTYPES:
        return None
    if hashlib.blake2b(payload, digest_size=16).hexdigest() != head["digest"]:
        return None
    dtype = _DTYPES[head["dtype"]]
    codec = head.get("codec", "raw")
    k_shape, v_shape = torch.Size(head["k_shape"]), torch.Size(head["v_shape"])
    if head.get("entropy"):
        payload = zlib.decompress(payload)
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    if codec == "raw":
        nk = k_shape.numel() * torch.empty(0, dtype=dtype).element_size()
        if flat.numel() != nk + v_shape.numel() * torch.empty(0, dtype=dtype).element_size():
            return None
        k = flat[:nk].view(dtype).view(k_shape)
        v = flat[nk:].view(dtype).view(v_shape)
        return head["namespace"], ChunkKV(k, v, head["context"])
    check_codec(codec)
    sizes = head["sizes"]
    if sum(sizes) != flat.numel():
        return None
    cuts, at = [], 0
    for s in sizes:
        cuts.append(flat[at : at + s])
        at += s
    kc, ks, kl, vc, vs, vl = cuts
    layers, t, kvh, hd = k_shape
    kg, vg = head["k_group"], head["v_group"]
    nkg = -(-t // kg)
    k_groups = (layers, kvh, hd, nkg)
    v_groups = (layers, t, kvh, hd // vg)
    if codec == "int4":
        kc = _unpack4(kc, layers * kvh * hd * nkg * kg)
        vc = _unpack4(vc, v_shape.numel())
    if head.get("k_layout") == "tokens":
        scales = (layers, nkg, kvh, hd)
        kq = _dequantize(kc.view(layers, nkg, kg, kvh, hd), ks.view(torch.float16).view(scales),
                         kl.view(torch.float16).view(scales), dtype, dim=2)
        k = kq.view(layers, nkg * kg, kvh, hd)[:, :t]
        k = k if nkg * kg == t else k.contiguous()
    else:  # the first version's channel-major groups
        kq = _dequantize(kc.view(*k_groups, kg), ks.view(torch.float16).view(k_groups),
                         kl.view(torch.float16).view(k_groups), dtype)
        k = kq.reshape(layers, kvh, hd, nkg * kg)[..., :t].permute(0, 3, 1, 2).contiguous()
    v = _dequantize(vc.view(*v_groups, vg), vs.view(torch.float16).view(v_groups), vl.view(torch.float16).view(v_groups),
                    dtype).reshape(v_shape)
    # quantized KV keeps the context it was computed in: the planner may take it for a prefix
    # (CacheGen's use of quantized KV; Config.kv_quantized_prefix), else it is blended
    return head["namespace"], ChunkKV(k, v, head["context"], quantized=True)


def error_bound(x: torch.Tensor, codec: str, kind: str) -> torch.Tensor:
    """Per layer, the largest absolute error `codec` may leave on K (kind "k") or V ("v")
    [L, T, KV, hd]: half a step of the widest group, plus the fp16 rounding of its scale
    and minimum (what the round-trip test checks against)."""
    if codec == "raw":
        return torch.zeros(x.shape[0])
    qmax = (1 << _BITS[codec]) - 1
    layers, t, kvh, hd = x.shape
    g = _k_groups(x, k_group(t)) if kind == "k" else x.reshape(layers, t, kvh, hd // _v_group(hd), _v_group(hd))
    g = g.float()
    span = (g.amax(-1) - g.amin(-1)).reshape(layers, -1)
    mag = g.abs().amax(-1).reshape(layers, -1)
    # half a step; the step's fp16 rounding over qmax steps (2^-11 relative); the minimum's rounding
    return (span / qmax / 2 + span * 2.0 ** -11 + mag * 2.0 ** -11).amax(1) + 1e-6
