"""MlakitCpuPlatform: vLLM's CPU platform, changed only where mlakit's backend is the one selected.

Loaded by vLLM through the `vllm.platform_plugins` entry point (`mlakit.vllm:cpu_platform`). With
`--attention-backend CUSTOM` (registered to mlakit) on an MLA model:

- `get_attn_backend_cls` answers mlakit's backend (the stock one answers CPU_MLA, or AMX_MLA, whatever
  is asked), after the backend's own checks; a KV-cache dtype it cannot read is refused naming
  `--kv-cache-dtype`;
- `check_and_update_config` keeps chunked prefill, prefix caching and the batched-token budget as
  vLLM's arguments set them (the stock platform turns the first two off for MLA and raises the budget
  to the context length), and the block size as asked (the stock platform forces 16 for CPU_MLA's
  kernel; mlakit reads any block size, 128 when none is asked, vLLM's CPU default).

Any other backend: exactly vLLM's CpuPlatform.
"""

from __future__ import annotations

from vllm.logger import init_logger
from vllm.platforms.cpu import CpuPlatform

from mlakit.vllm import BACKEND_PATH, is_selected

# a name under "vllm": vLLM configures that logger tree only
logger = init_logger("vllm.plugins.mlakit")

# the block size vLLM's CPU platform picks when none is asked (for every backend but CPU_MLA)
DEFAULT_BLOCK_SIZE = 128


class MlakitCpuPlatform(CpuPlatform):
    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        if not (attn_selector_config.use_mla and _is_mlakit(selected_backend)):
            return super().get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)
        from mlakit.vllm.backend import MlakitMLABackend

        reasons = MlakitMLABackend.refusals(attn_selector_config)
        if reasons:
            raise ValueError(
                "--attention-backend CUSTOM (mlakit) cannot run this configuration: " + "; ".join(reasons)
            )
        logger.info_once("Using mlakit's MLA backend (CUSTOM).")
        return BACKEND_PATH

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        model_config = vllm_config.model_config
        ours = (
            model_config is not None
            and getattr(model_config, "use_mla", False)
            and getattr(model_config.hf_config, "model_type", None) != "deepseek_v4"
            and is_selected(vllm_config.attention_config)
        )
        if not ours:
            super().check_and_update_config(vllm_config)
            return
        sched, cache = vllm_config.scheduler_config, vllm_config.cache_config
        kept = (sched.enable_chunked_prefill, cache.enable_prefix_caching, sched.max_num_batched_tokens)
        asked_block = cache.block_size if cache.user_specified_block_size else None
        super().check_and_update_config(vllm_config)
        sched.enable_chunked_prefill, cache.enable_prefix_caching, sched.max_num_batched_tokens = kept
        cache.block_size = asked_block if asked_block is not None else DEFAULT_BLOCK_SIZE
        logger.info_once(
            "mlakit: MLA on CPU with chunked prefill %s, prefix caching %s, block size %d",
            "on" if kept[0] else "off",
            "on" if kept[1] else "off",
            cache.block_size,
        )


def _is_mlakit(selected_backend) -> bool:
    if selected_backend is None or getattr(selected_backend, "name", None) != "CUSTOM":
        return False
    return selected_backend.is_overridden() and selected_backend.get_path() == BACKEND_PATH
