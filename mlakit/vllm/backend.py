"""MlakitMLABackend: mlakit's MLA attention as a vLLM attention backend (`--attention-backend CUSTOM`).

What stays vLLM's: the scheduler, the paging (block tables, prefix cache), the cache writes
(`do_kv_cache_update`, here the same indexed write as CPU_MLA's), the projections around attention,
the query fold and value unfold of decode rows (`MLAAttention.forward_impl`), MoE, collectives.

What is mlakit's:
- decode rows (`forward_mqa`): the absorbed latent attention over vLLM's pages read in place — the
  fused AVX512-BF16 core through a [B, keys] table of pool rows where it runs (bf16 caches), the torch
  core over pool rows gathered 1,024 keys at a time elsewhere (fp32), mlakit's Triton kernel straight
  from the block table on CUDA. No copy of the cache per step.
- prefill rows (`forward_mha`): each chunk over its cached prefix runs absorb or materialize as the
  cost model (or a `mlakit calibrate` profile) decides; vLLM always materializes there.
- the decode/prefill split (`reorder_batch_threshold`): from the same model (`policy.decode_threshold`).

The pool is vLLM's [num_blocks, block_size, kv_lora_rank + rope] cache at any block size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
    split_kv_b_proj,
)
from vllm.v1.attention.backend import AttentionType, MultipleOf

from mlakit.calibration import find_profile
from mlakit.ops.absorb import latent_attention
from mlakit.ops.common import acc_dtype, context_mask
from mlakit.ops.cpu_core import fused_latent, use_fused
from mlakit.ops.materialize import materialize
from mlakit.ops.merge import merge
from mlakit.ops.paged import absorb_chunked
from mlakit.ops.reference import reference
from mlakit.vllm.policy import chunk_path, decode_threshold, layer_config, page_rows, runs

# MLAKIT_VLLM_CHECK=1: every call is also computed by the fp64 oracle (mlakit.ops.reference) from the
# same queries and the same pages, and the worst gap per path is kept in MlakitMLAImpl.worst (tests,
# debugging; slow)
CHECK = os.environ.get("MLAKIT_VLLM_CHECK", "0") == "1"
# keys of pool rows gathered per step of the torch core (a bounded workspace, never the whole context)
CHUNK_KEYS = 1024
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def _profile(cfg, dtype: torch.dtype, device: torch.device):
    name = DTYPE_NAMES.get(dtype)
    return None if name is None else find_profile(cfg, name, device.type)


class MlakitMLABackend(MLACommonBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    # vLLM's unquantized MLA rows; an fp8 cache is refused naming --kv-cache-dtype (`refusals`)
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[MlakitMLAImpl]:
        return MlakitMLAImpl

    @staticmethod
    def get_builder_cls() -> type[MlakitMLAMetadataBuilder]:
        return MlakitMLAMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any kv_lora_rank + rope (the fused CPU core wants a latent multiple of 32)

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        # mlakit's Triton kernel: bf16/fp16 tiles from compute capability 8.0
        return capability is None or capability.to_int() >= 80

    @classmethod
    def refusals(cls, selector) -> list[str]:
        """Why this backend cannot run a vLLM attention-selector configuration (empty: it can)."""
        out = []
        if selector.kv_cache_dtype not in (None, "auto"):
            out.append(
                f"--kv-cache-dtype {selector.kv_cache_dtype}: mlakit's vLLM backend reads vLLM's "
                "unquantized MLA cache only (leave --kv-cache-dtype at auto)"
            )
        if selector.dtype not in cls.supported_dtypes:
            out.append(f"--dtype {selector.dtype}: expected one of float32, bfloat16, float16")
        if selector.use_sparse:
            out.append("sparse MLA (DeepSeek-V3.2 / GLM-5 DSA) is not served by mlakit's vLLM backend")
        if selector.has_sliding_window:
            out.append("sliding-window MLA is not served by mlakit's vLLM backend")
        if selector.attn_type != AttentionType.DECODER:
            out.append(f"attention type {selector.attn_type}: decoder self-attention only")
        if getattr(selector, "use_dcp", False) or getattr(selector, "use_pcp", False):
            out.append("decode/prefill context parallel: use tensor parallel (-tp) instead")
        return out


@dataclass
class MlakitDecodeMetadata(MLACommonDecodeMetadata):
    query_lens: list[int] | None = None  # host: new tokens of each decode row
    rows: torch.Tensor | None = None  # [B, keys] pool rows (CPU), built once per step
    max_keys: int = 0


@dataclass
class MlakitMLAMetadata(MLACommonMetadata[MlakitDecodeMetadata]):
    def __post_init__(self):
        pass  # MLACommonMetadata allows head sizes 320/512/576 only; mlakit takes any


class MlakitMLAMetadataBuilder(MLACommonMetadataBuilder[MlakitMLAMetadata]):
    # decode rows of several new tokens (short chunks, speculative tokens), lengths mixed
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.VARLEN

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, metadata_cls=MlakitMLAMetadata)
        d = self.mla_dims
        self.cfg = layer_config(
            self.num_heads,
            d.kv_lora_rank,
            d.qk_nope_head_dim,
            d.qk_rope_head_dim,
            d.v_head_dim,
            d.q_lora_rank,
        )
        self.profile = _profile(self.cfg, self.model_config.dtype, torch.device(device))
        # a row of at most this many new tokens is cheaper absorbed over any cached prefix of one block
        # or more; longer rows are decided one by one over their own prefix (forward_mha)
        threshold = decode_threshold(self.cfg, self.page_size, self.profile)
        self._init_reorder_batch_threshold(threshold, True, False)

    def _build_decode(
        self,
        block_table_tensor,
        seq_lens_device,
        max_seq_len,
        query_start_loc_cpu,
        query_start_loc_device,
        num_decode_tokens,
        max_query_len,
        dcp_tot_seq_lens_device,
    ):
        qsl = query_start_loc_cpu.tolist()
        query_lens = [qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)]
        rows = None
        if block_table_tensor.device.type == "cpu":
            rows = page_rows(block_table_tensor, self.page_size, max_seq_len)
        return MlakitDecodeMetadata(
            block_table=block_table_tensor,
            seq_lens=seq_lens_device,
            dcp_tot_seq_lens=dcp_tot_seq_lens_device,
            query_lens=query_lens,
            rows=rows,
            max_keys=max_seq_len,
        )

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        prefill = meta.prefill
        if prefill is not None:
            # host facts of each prefill row: its new tokens and its whole length (prefix included)
            start, stop = meta.num_decodes, meta.num_decodes + meta.num_prefills
            seq_lens = common_attn_metadata.seq_lens_cpu_upper_bound[
                start:stop
            ].tolist()  # exact for prefills
            prefill.mlakit_query_lens = prefill.query_lens_cpu.tolist()
            prefill.mlakit_seq_lens = seq_lens
            prefill.mlakit_rows = page_rows(prefill.block_table, self.page_size, max(seq_lens))
        return meta


class MlakitMLAImpl(MLACommonImpl[MlakitMLAMetadata]):
    can_return_lse_for_decode: bool = True
    # layer calls of each path in this process (read by tests and the benchmark: which core ran)
    counts: ClassVar[dict[str, int]] = dict.fromkeys(
        ("decode_fused", "decode_torch", "decode_triton", "prefill_absorb", "prefill_materialize"), 0
    )
    # MLAKIT_VLLM_CHECK=1: the largest |mlakit - fp64 oracle| seen per path
    worst: ClassVar[dict[str, float]] = {}

    def __init__(
        self,
        num_heads,
        head_size,
        scale,
        num_kv_heads,
        alibi_slopes,
        sliding_window,
        kv_cache_dtype,
        logits_soft_cap,
        attn_type,
        kv_sharing_target_layer_name,
        **mla_args,
    ) -> None:
        if any((alibi_slopes, sliding_window, logits_soft_cap)):
            raise NotImplementedError("mlakit's MLA backend has no alibi, sliding window or logits soft cap")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"mlakit's MLA backend runs decoder self-attention, not {attn_type}")
        super().__init__(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            alibi_slopes,
            sliding_window,
            kv_cache_dtype,
            logits_soft_cap,
            attn_type,
            kv_sharing_target_layer_name,
            **mla_args,
        )
        if self.dcp_world_size > 1:
            raise NotImplementedError("mlakit's MLA backend: decode context parallel is not supported")
        self.supports_quant_query_input = False
        self._pad_v = False
        self.cfg = layer_config(
            num_heads,
            self.kv_lora_rank,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
            self.q_lora_rank,
        )
        self.w_uk = self.w_uv = None
        self.profile = None
        self._layout = None

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        # forward_mha has no `layer` argument: keep W_UK [H, dn, L] and W_UV [H, dv, L] here
        w_uk, w_uv = split_kv_b_proj(
            self.kv_b_proj,
            act_dtype,
            self.kv_lora_rank,
            self.num_heads,
            self.qk_nope_head_dim,
            self.v_head_dim,
        )
        self.w_uk = w_uk.permute(1, 2, 0).contiguous()
        self.w_uv = w_uv.permute(1, 2, 0).contiguous()
        self.profile = _profile(self.cfg, act_dtype, self.w_uk.device)

    # -- the cache ---------------------------------------------------------------------------------
    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale) -> None:
        if kv_cache.numel() == 0:
            return
        if kv_cache_dtype != "auto":
            raise ValueError(f"--kv-cache-dtype {kv_cache_dtype}: mlakit's vLLM backend reads 'auto' only")
        latent = kv_c_normed.shape[-1]
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        slots = slot_mapping.flatten().to(torch.long)
        valid = slots >= 0  # padding slots are -1
        if slots.device.type == "cpu" and bool(valid.all()):
            flat[slots, :latent] = kv_c_normed.to(flat.dtype)
            flat[slots, latent:] = k_pe.reshape(slots.shape[0], -1).to(flat.dtype)
            return
        rows = slots[valid]
        flat[rows, :latent] = kv_c_normed[valid].to(flat.dtype)
        flat[rows, latent:] = k_pe.reshape(slots.shape[0], -1)[valid].to(flat.dtype)

    def _pools(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(c_kv rows [N, L], k_pe rows [N, dr]): strided views of vLLM's pool, nothing copied."""
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        return flat[:, : self.kv_lora_rank], flat[:, self.kv_lora_rank :]

    # -- decode rows: absorbed, over the pages in place ----------------------------------------------
    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        dec = attn_metadata.decode
        ql_nope, q_pe = q if isinstance(q, tuple) else q.split([self.kv_lora_rank, self.qk_rope_head_dim], -1)
        tokens, heads, latent = ql_nope.shape
        out = ql_nope.new_empty(tokens, heads, latent)
        lse = torch.empty(tokens, heads, dtype=torch.float32, device=ql_nope.device)
        ckv, kpe = self._pools(kv_c_and_k_pe_cache)
        token = 0
        for first, last, new in runs(dec.query_lens):
            count = (last - first) * new
            if new == 0:
                continue
            q_lat = ql_nope[token : token + count].view(last - first, new, heads, latent)
            q_rope = q_pe[token : token + count].view(last - first, new, heads, -1)
            kv_lens = dec.seq_lens[first:last]
            if kv_c_and_k_pe_cache.device.type == "cuda":
                o, l = self._triton_latent(
                    q_lat, q_rope, kv_c_and_k_pe_cache, dec.block_table[first:last], kv_lens
                )
            else:
                o, l = self._cpu_latent(q_lat, q_rope, ckv, kpe, dec.rows[first:last], kv_lens)
            if CHECK:
                self._check_latent(q_lat, q_rope, ckv, kpe, dec, first, last, kv_lens, o)
            out[token : token + count] = o.reshape(count, heads, latent).to(out.dtype)
            lse[token : token + count] = l.reshape(count, heads)
            token += count
        return out, lse

    def _cpu_latent(self, q_lat, q_pe, ckv, kpe, rows, kv_lens):
        """Latent attention of q_lat [B,S,H,L] over each row's pool rows: (o_lat fp32, lse)."""
        kv_lens = kv_lens.to(torch.long)
        keys = int(kv_lens.max())
        if use_fused("auto", q_lat, ckv, kpe):
            self.counts["decode_fused"] += 1
            return fused_latent(q_lat, q_pe, ckv, kpe, kv_lens, self.scale, rows=rows[:, :keys])
        self.counts["decode_torch"] += 1
        o_lat = lse = None
        new = q_lat.shape[1]
        for start in range(0, keys, CHUNK_KEYS):
            stop = min(keys, start + CHUNK_KEYS)
            idx = rows[:, start:stop]
            mask = context_mask(kv_lens, new, 0, new, start, stop, q_lat.device, None, False)
            part = latent_attention(q_lat, q_pe, ckv[idx], kpe[idx], mask, self.scale)
            part = (part[0].to(acc_dtype(part[0].dtype)), part[1])
            o_lat, lse = part if o_lat is None else merge([o_lat, part[0]], [lse, part[1]])
        return o_lat, lse

    def _triton_latent(self, q_lat, q_pe, kv_cache, block_table, kv_lens):
        from mlakit.cache.quant import token_layout
        from mlakit.kernels.absorb_decode import absorb_decode

        if self._layout is None:
            self._layout = token_layout(self.cfg, kv_cache.dtype, None)
        self.counts["decode_triton"] += 1
        return absorb_decode(q_lat, q_pe, kv_cache, block_table, kv_lens, self._layout, self.scale)

    # -- prefill rows: absorb or materialize per chunk -------------------------------------------------
    def forward_mha(
        self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale, output, output_scale=None
    ) -> None:
        if output_scale is not None:
            raise NotImplementedError("mlakit's MLA backend does not fuse output quantization")
        pre = attn_metadata.prefill
        heads, dn, dr, dv = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        ckv, kpe = self._pools(kv_c_and_k_pe_cache)
        out = output.view(-1, heads, dv)
        k_pe = k_pe.reshape(k_pe.shape[0], -1)
        token = 0
        for i, (new, length) in enumerate(zip(pre.mlakit_query_lens, pre.mlakit_seq_lens, strict=True)):
            q_i = q[token : token + new].view(1, new, heads, dn + dr)
            q_nope, q_rope = q_i[..., :dn], q_i[..., dn:]
            kv_lens = torch.tensor([length], dtype=torch.long)
            rows = pre.mlakit_rows[i : i + 1, :length]
            path = chunk_path(self.cfg, new, length - new, self.profile)
            self.counts["prefill_" + path] += 1
            if path == "absorb":
                o = self._absorb(q_nope, q_rope, ckv, kpe, rows, kv_lens, kv_c_and_k_pe_cache, pre, i)
            else:
                if length == new:  # no cached prefix: the chunk's own latents, no read of the pool
                    c, r = kv_c_normed[token : token + new][None], k_pe[token : token + new][None]
                else:  # materialize up-projects every cached latent anyway: gather the row's context
                    c, r = ckv[rows], kpe[rows]
                o, _ = materialize(
                    q_nope, q_rope, c, r, kv_lens, self.w_uk, self.w_uv, self.scale, need_lse=False
                )
            if CHECK:
                want = reference(
                    q_nope, q_rope, ckv[rows], kpe[rows], kv_lens, self.w_uk, self.w_uv, self.scale
                )[0]
                _worst("prefill_" + path, o, want)
            out[token : token + new] = o[0].to(out.dtype)
            token += new

    def _check_latent(self, q_lat, q_rope, ckv, kpe, dec, first, last, kv_lens, o):
        """The fp64 oracle over the same pages: identity up-projections give the latent output."""
        eye = torch.eye(self.kv_lora_rank, dtype=torch.float64).expand(self.num_heads, -1, -1)
        if dec.rows is None:  # CUDA: the kernel's own tests cover it
            return
        rows = dec.rows[first:last, : int(kv_lens.max())]
        c, r = ckv[rows].cpu(), kpe[rows].cpu()
        want = reference(q_lat.cpu(), q_rope.cpu(), c, r, kv_lens.cpu(), eye, eye, self.scale)[0]
        _worst("decode", o, want)

    def _absorb(self, q_nope, q_rope, ckv, kpe, rows, kv_lens, kv_cache, pre, i):
        if kv_cache.device.type == "cuda":
            from mlakit.kernels.paged import absorb_paged

            if self._layout is None:
                from mlakit.cache.quant import token_layout

                self._layout = token_layout(self.cfg, kv_cache.dtype, None)
            table = pre.block_table[i : i + 1]
            return absorb_paged(
                q_nope,
                q_rope,
                kv_cache,
                table,
                kv_lens.to(kv_cache.device),
                self.w_uk,
                self.w_uv,
                self.scale,
                layout=self._layout,
            )[0]

        def read(start, stop):
            idx = rows[:, start:stop]
            return ckv[idx], kpe[idx]

        return absorb_chunked(
            q_nope, q_rope, read, kv_lens, self.w_uk, self.w_uv, self.scale, pages=(ckv, kpe, rows)
        )[0]


def _worst(path: str, got: torch.Tensor, want: torch.Tensor) -> None:
    gap = float((got.double().cpu() - want.double().cpu()).abs().max())
    MlakitMLAImpl.worst[path] = max(MlakitMLAImpl.worst.get(path, 0.0), gap)
