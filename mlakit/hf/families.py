"""Every MLA attention class transformers ships, and how mlakit serves it (or why it does not yet).

`FAMILIES` maps a transformers attention class name to a `Family`: where its modeling module lives,
its rope convention, and the few extras some families add to DeepSeek-V3's attention (a scale on the
query and on the normalized latent, a per-position query scale, a per-head output gate). An entry whose
`refused` is a reason is recognized as MLA but refused with that reason; setting it to None (once its
extra is served) is all it takes to support it. Torch-free: read by `mlakit models` and the docs table.
"""

from __future__ import annotations

from dataclasses import dataclass

# the DSA indexer itself is served (mlakit.hf.dsa: DeepSeek-V3.2, GLM-5); these families refuse for
# what they add beside it, named after this prefix
DSA_REASON = "DSA indexer served (as DeepSeek-V3.2's, GLM-5's); not yet:"

# rope conventions: "complex" (DeepSeek-V2's freqs_cis), "config" (config.rope_interleave picks
# interleaved pairs or two halves), "interleave", "half", "none" (NoPE: no rotation at all)
ROPE_KINDS = ("complex", "config", "interleave", "half", "none")


@dataclass(frozen=True)
class Family:
    model_type: str  # transformers model_type of the (text) config
    module: str  # modeling module, under transformers.models
    config: str  # config class name (the text config for multimodal families)
    rope: str  # one of ROPE_KINDS
    models: tuple[str, ...] = ()  # causal-LM and base model classes that hold this attention
    q_scale: str | None = None  # attribute of the layer multiplying q_nope and q_pe before rope
    kv_scale: str | None = None  # attribute of the layer multiplying the normalized latent c_kv
    query_position_scale: bool = False  # Llama-4 style log(position) query scale (Mistral 4)
    head_gate: str | None = None  # submodule: out[b,s,h,:] *= sigmoid(gate(hidden)[b,s,h])
    differences: str = ""  # what differs from DeepSeek-V3's attention, for the docs and `mlakit models`
    refused: str | None = None  # None: mlakit patches it; else the reason it is refused

    @property
    def modeling_module(self) -> str:
        return f"transformers.models.{self.module}.modeling_{self.module}"


def _f(model_type, config, rope, *models, module=None, **kw) -> Family:
    return Family(model_type, module or model_type, config, rope, tuple(models), **kw)


FAMILIES: dict[str, Family] = {
    "DeepseekV2Attention": _f(
        "deepseek_v2",
        "DeepseekV2Config",
        "complex",
        "DeepseekV2ForCausalLM",
        "DeepseekV2Model",
        differences="complex (freqs_cis) rope on interleaved pairs; q_lora optional (V2-Lite has none)",
    ),
    "DeepseekV3Attention": _f(
        "deepseek_v3",
        "DeepseekV3Config",
        "config",
        "DeepseekV3ForCausalLM",
        "DeepseekV3Model",
        differences="the reference; also Kimi K2/K2.5 and Sarvam-M (sarvam_mla) load as DeepSeek-V3",
    ),
    "Glm4MoeLiteAttention": _f(
        "glm4_moe_lite",
        "Glm4MoeLiteConfig",
        "config",
        "Glm4MoeLiteForCausalLM",
        "Glm4MoeLiteModel",
        differences="none in the attention (v_head_dim 256 ≠ nope 192)",
    ),
    "MiniCPM3Attention": _f(
        "minicpm3",
        "MiniCPM3Config",
        "half",
        "MiniCPM3ForCausalLM",
        "MiniCPM3Model",
        differences="half-split rope always; v_head_dim defaults to hidden/heads",
    ),
    "YoutuAttention": _f(
        "youtu", "YoutuConfig", "config", "YoutuForCausalLM", "YoutuModel", differences="none"
    ),
    "AXK1Attention": _f(
        "axk1", "AXK1Config", "config", "AXK1ForCausalLM", "AXK1Model", differences="q_lora always"
    ),
    "Mistral4Attention": _f(
        "mistral4",
        "Mistral4Config",
        "config",
        "Mistral4ForCausalLM",
        "Mistral4Model",
        query_position_scale=True,
        differences="YaRN with partial rotary factor; Llama-4 query scale 1+β·log(1+⌊pos/orig⌋)",
    ),
    "LongcatFlashMLA": _f(
        "longcat_flash",
        "LongcatFlashConfig",
        "interleave",
        "LongcatFlashForCausalLM",
        "LongcatFlashModel",
        q_scale="mla_scale_q_lora",
        kv_scale="mla_scale_kv_lora",
        differences="two MLA sublayers per decoder layer; q ×√(D/q_rank), cached latent ×√(D/L)",
    ),
    "KimiLinearAttention": _f(
        "kimi_linear",
        "KimiLinearConfig",
        "none",
        "KimiLinearForCausalLM",
        "KimiLinearModel",
        differences="hybrid with KDA linear layers (only the MLA layers patched); NoPE: k_pe unrotated",
    ),
    "BailingHybridAttention": _f(
        "bailing_hybrid",
        "BailingHybridConfig",
        "interleave",
        "BailingHybridForCausalLM",
        "BailingHybridModel",
        head_gate="g_proj",
        differences="hybrid with linear-attention layers (only the MLA layers patched); per-head sigmoid "
        "output gate g_proj",
    ),
    # DSA families: the indexer (mlakit/hf/dsa.py) flips these entries
    "DeepseekV32Attention": _f(
        "deepseek_v32",
        "DeepseekV32Config",
        "interleave",
        "DeepseekV32ForCausalLM",
        "DeepseekV32Model",
        differences="DeepSeek-V3 with a DSA indexer",
        refused=None,  # served by mlakit.hf.dsa
    ),
    "GlmMoeDsaAttention": _f(
        "glm_moe_dsa",
        "GlmMoeDsaConfig",
        "interleave",
        "GlmMoeDsaForCausalLM",
        "GlmMoeDsaModel",
        differences="DSA indexer with top-k shared across layers (indexer_types)",
        refused=None,  # served by mlakit.hf.dsa
    ),
    "AXK2Attention": _f(
        "axk2",
        "AXK2Config",
        "interleave",
        "AXK2ForCausalLM",
        differences="DSA indexer; fused q_gate_proj over [norm(q_a) | q_a] and a sigmoid output gate",
        refused=f"{DSA_REASON} its fused q_gate_proj and sigmoid output gate",
    ),
    "HYV4Attention": _f(
        "hy_v4",
        "HYV4Config",
        "half",
        "HYV4ForCausalLM",
        differences="DSA indexer with shared top-k; attention sinks; per-head-dim sigmoid gate",
        refused=f"{DSA_REASON} attention sinks and the gate_proj output gate",
    ),
    "HYV4VLAttention": _f(
        "hy_v4_vl",
        "HYV4VLTextConfig",
        "half",
        differences="as HYV4 (text tower of the VL model), latent norms with rms_norm_eps",
        refused=f"{DSA_REASON} attention sinks and the gate_proj output gate",
    ),
    "MistralLarge4TextAttention": _f(
        "mistral_large4_text",
        "MistralLarge4TextConfig",
        "interleave",
        module="mistral_large4",
        differences="DSA indexer; latent shared across layers (kv_sharing_modes); NoPE layers; "
        "learned softmax scaling",
        refused=f"{DSA_REASON} the latent shared across layers (kv_sharing_modes), learned softmax scaling",
    ),
    "Dots3NoteTextAttention": _f(
        "dots3_note_text",
        "Dots3NoteTextConfig",
        "interleave",
        module="dots3_note",
        differences="per-layer kinds (sliding window / indexed); rms-normed k_pe; latent scales; "
        "per-head gate",
        refused=f"{DSA_REASON} sliding-window layers and an rms-normed rope key",
    ),
    "Glm5NextTextAttention": _f(
        "glm5_next_text",
        "Glm5NextTextConfig",
        "none",
        module="glm5_next",
        differences="NoPE MLA (qk_rope_head_dim 0) with a DSA indexer sharing top-k across layers",
        refused=f"{DSA_REASON} a zero rope width (NoPE MLA), which one MLAConfig cannot describe",
    ),
}


# attentions mlakit serves that are not MLA (one shared K = V head, no latent), kept out of FAMILIES
# (whose every entry is an MLA latent attention): DeepSeek-V4's compressed attention, mlakit.hf.v4
V4_FAMILIES: dict[str, Family] = {
    "DeepseekV4Attention": _f(
        "deepseek_v4",
        "DeepseekV4Config",
        "interleave",
        "DeepseekV4ForCausalLM",
        "DeepseekV4Model",
        differences="not MLA: shared K = V MQA with a 128-token window, compressed entries (CSA: 1 per 4 "
        "tokens, top-k by an indexer; HCA: 1 per 128, dense), sinks; served by mlakit.hf.v4 (mlakit.v4)",
        refused=None,  # served by mlakit.hf.v4, not by PatchedMLAAttention
    ),
}


def family(class_name: str) -> Family | None:
    return FAMILIES.get(class_name)


def supported() -> tuple[str, ...]:
    """Attention class names mlakit patches."""
    return tuple(name for name, f in FAMILIES.items() if f.refused is None)


def refused() -> dict[str, str]:
    """Attention class name → why mlakit refuses it."""
    return {name: f.refused for name, f in FAMILIES.items() if f.refused is not None}


def supported_models() -> tuple[str, ...]:
    return tuple(sorted(m for f in FAMILIES.values() if f.refused is None for m in f.models))
