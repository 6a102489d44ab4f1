"""Other engines' MLA decode kernels on the pages of `gpu_decode.Pool`, each behind one signature.

make(q_lat [B,1,H,L], q_pe [B,1,H,dr], pool, table [B,NB] int32, lens [B] int32, scale, fmt) returns a
zero-argument callable that runs one decode over the same rows, or None when the engine has no
kernel for that format. Their APIs move between releases: arguments are bound by parameter name
where the names are known, and a failure is reported by the caller as that backend's error.

- FlashMLA (`flash_mla`): bf16 rows are its [blocks, 64, 1, 576] layout as they are (512 latent +
  64 rope, 2 bytes each); fp8 656-byte rows are its fp8 layout, passed with is_fp8_kvcache=True.
- SGLang's and vLLM's Triton MLA decode (`decode_attention_fwd`): bf16 only, K = V = the rows,
  V the first 512 values. SGLang's takes token indices (page size 1), vLLM's the block table.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect

import torch

BLOCK = 64
SPLITS = 8  # the split count both Triton engines default to for decode


def _bf16_rows(pool) -> torch.Tensor:
    """[blocks, 64, 1, 576] bf16 view of bf16 pages (latent then rope, no padding)."""
    lay = pool.layout
    return pool.pages.view(torch.bfloat16).view(pool.pages.shape[0], BLOCK, 1, lay.row_bytes // 2)


def _bind(fn, values: dict):
    """Call `fn` with the values its signature names (positional order kept)."""
    params = inspect.signature(fn).parameters
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in values]
    if missing:
        raise TypeError(f"{fn.__module__}.{fn.__name__} wants {missing}, which this adapter does not know")
    kwargs = {n: values[n] for n in params if n in values}
    return lambda: fn(**kwargs)


def flashmla(q_lat, q_pe, pool, table, lens, scale, fmt):
    fm = importlib.import_module("flash_mla")
    batch, new, heads, _ = q_lat.shape
    q = torch.cat([q_lat, q_pe], dim=-1).to(torch.bfloat16).contiguous()  # [B, 1, H, 576]
    if fmt == "bf16":
        cache, fp8 = _bf16_rows(pool), False
    else:
        cache, fp8 = pool.pages.view(pool.pages.shape[0], BLOCK, 1, pool.layout.row_bytes), True
        cache = cache.view(torch.float8_e4m3fn)
    meta_fn = fm.get_mla_metadata
    meta_params = inspect.signature(meta_fn).parameters
    if "is_fp8_kvcache" in meta_params:
        meta = meta_fn(lens, new * heads, 1, is_fp8_kvcache=fp8)
    elif fp8:
        return None
    else:
        meta = meta_fn(lens, new * heads, 1)
    sched, splits = meta if isinstance(meta, tuple) else (meta, None)
    values = {
        "q": q, "k_cache": cache, "block_table": table, "cache_seqlens": lens, "head_dim_v": 512,
        "tile_scheduler_metadata": sched, "num_splits": splits, "softmax_scale": scale, "causal": True,
        "is_fp8_kvcache": fp8,
    }  # fmt: skip
    return _bind(fm.flash_mla_with_kvcache, values)


def _triton_common(q_lat, q_pe, pool, lens, scale):
    batch, _, heads, lat = q_lat.shape
    q = torch.cat([q_lat, q_pe], dim=-1)[:, 0].to(torch.bfloat16).contiguous()  # [B, H, 576]
    rows = _bf16_rows(pool).view(-1, 1, pool.layout.row_bytes // 2)  # [tokens, 1, 576]
    f32 = {"dtype": torch.float32, "device": q.device}
    return {
        "q": q, "k_buffer": rows, "v_buffer": rows[..., :lat], "sm_scale": scale, "logit_cap": 0.0,
        "o": torch.empty(batch, heads, lat, dtype=torch.bfloat16, device=q.device),
        "b_seq_len": lens, "num_kv_splits": SPLITS, "max_kv_splits": SPLITS,
        "attn_logits": torch.empty(batch, heads, SPLITS, lat, **f32),
        "attn_lse": torch.empty(batch, heads, SPLITS, **f32),
        "lse": torch.empty(batch, heads, **f32),
    }  # fmt: skip


def sglang_triton(q_lat, q_pe, pool, table, lens, scale, fmt):
    if fmt != "bf16":
        return None
    mod = importlib.import_module("sglang.srt.layers.attention.triton_ops.decode_attention")
    values = _triton_common(q_lat, q_pe, pool, lens, scale)
    batch, context = table.shape[0], int(table.shape[1]) * BLOCK
    t = torch.arange(context, device=table.device)
    tokens = (table[:, t // BLOCK].long() * BLOCK + t % BLOCK).to(torch.int32)  # [B, T], all rows full
    values["kv_indices"] = tokens.reshape(-1)
    values["kv_indptr"] = torch.arange(
        0, (batch + 1) * context, context, dtype=torch.int32, device=table.device
    )
    values["num_kv_splits"] = torch.full((batch,), SPLITS, dtype=torch.int32, device=table.device)
    values["attn_logits"] = values["attn_logits"].view(batch, q_lat.shape[2], SPLITS, -1)
    return _bind(mod.decode_attention_fwd, values)


def vllm_triton(q_lat, q_pe, pool, table, lens, scale, fmt):
    if fmt != "bf16":
        return None
    try:
        mod = importlib.import_module("vllm.attention.ops.triton_decode_attention")
    except ImportError:
        mod = importlib.import_module("vllm.v1.attention.ops.triton_decode_attention")
    values = _triton_common(q_lat, q_pe, pool, lens, scale)
    values["k_buffer"] = _bf16_rows(pool)  # [blocks, 64, 1, 576]
    values["v_buffer"] = values["k_buffer"][..., : q_lat.shape[-1]]
    values["req_to_token"] = values["req_to_tokens"] = table
    values["page_size"] = BLOCK
    lat = q_lat.shape[-1]
    values["attn_logits"] = torch.empty(*values["attn_logits"].shape[:3], lat + 1, **_f32(q_lat))
    return _bind(mod.decode_attention_fwd, values)


def _f32(t: torch.Tensor) -> dict:
    return {"dtype": torch.float32, "device": t.device}


ENGINES = {
    "flashmla": (flashmla, "flash_mla"),
    "sglang triton": (sglang_triton, "sglang.srt.layers.attention.triton_ops.decode_attention"),
    "vllm triton": (vllm_triton, "vllm"),
}


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def available() -> tuple[dict, list[str]]:
    """({name: make} of the engines importable here, [names skipped and why])."""
    found, skipped = {}, []
    for name, (make, module) in ENGINES.items():
        if importable(module):
            found[name] = make
        else:
            skipped.append(f"{name}: {module} not importable")
    return found, skipped
