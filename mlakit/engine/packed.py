"""Prepacked weights for the engine's eager CPU steps: every projection the model runs as a GEMM
(attention q/kv-a/o projections, dense MLPs, lm_head; the MoE experts through GroupedMoE.pack) keeps
its weight in oneDNN's blocked layout instead of the plain [out, in] one. bf16 weights are packed on
CPUs with native bf16; fp32 weights where a probe (`fp32_packs`) finds oneDNN's packed fp32 product
faster than torch's plain one (MKL) at decode row counts.

Why: torch's bf16 `F.linear` on a CPU without AMX reorders the weight into oneDNN's layout at every
call; at the few rows of a decode step that reorder costs as much as the product. The prepacked
product is bit-identical to `F.linear` (tests/test_engine_packed.py) and faster at every row count
measured (Intel Xeon AVX512-BF16 without AMX, one thread, GF/s, F.linear -> packed, DEMO widths):
1 row 13 -> 25, 4 rows 38 -> 67, 8 rows 49 -> 75, 32 rows 71 -> 85, 128 rows 79 -> 83 (the 1,024 x
5,632 MLP gate/up; the other projections alike, benchmarks/packed_linear.py).

fp32 (an AVX2-only AMD EPYC, Zen 1, where mlakit computes in fp32; one thread, GF/s, plain F.linear
(MKL) -> packed, DEMO widths): 8 rows 10-21 -> 18-28, 32 rows 18-31 -> 29-34, 128 rows 27-34 -> 34-37;
the lm_head (129,280 x 1,024) at 8 rows 201 -> 89 ms; but 1 row 6-17 -> 4-8 (a lone sequence decodes
slower). The fp32 products are not bit-identical to MKL's (another summation order), only within
fp32 rounding of them.

The packed weight replaces the plain one (memory neutral): `PackedLinear.weight` rebuilds the plain
tensor on demand, and `unpack_model` puts nn.Linear modules back. Not packed: `kv_b_proj` (mlakit's
attention reads its weight as per-head views for absorb), linears whose weight another module shares
(a tied lm_head), fp16 weights, fp32 weights where the probe finds no gain, CUDA, and bf16 weights on
CPUs without native bf16 (mlakit.linear.Linear's fp32 route is what runs there). torch.compile cannot
trace the packed layout: a compiled step calls each packed product as one opaque op
(mlakit/engine/compiled.py), on the same packed weight.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from mlakit.engine import compiled
from mlakit.linear import Linear
from mlakit.ops.vnni import VnniWeight, vnni_packs

# weights read by mlakit itself as tensors (views), never packed
KEEP_PLAIN = ("kv_b_proj",)
# row counts at which `upcast_rows` compares the packed bf16 product with the fp32 one, and its probe
# weight (out x in): a prefill chunk's projections are of this order
PROBE_ROWS = (256, 512, 1024)
PROBE_WEIGHT = (2048, 1024)
# the fp32 route must win by this factor to be taken (the probe runs on shared cores)
PROBE_MARGIN = 1.1
_UPCAST = []  # the probe's answer, once per process
# rows at which `fp32_packs` compares the packed fp32 product with the plain one (a decode step's)
FP32_PROBE_ROWS = (8, 32)
_FP32 = []  # its answer, once per process


def packs(dtype: torch.dtype, device) -> bool:
    """Whether weights of `dtype` on `device` are prepacked: bf16 on a CPU whose oneDNN build runs bf16
    natively (AVX512-BF16 or AMX; not AVX2-only CPUs, where mlakit multiplies in fp32), fp32 on a CPU
    where `fp32_packs` finds the packed product faster."""
    if not (
        torch.device(device).type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32 and fp32_packs()


def fp32_packs() -> bool:
    """Whether oneDNN's prepacked fp32 product beats torch's plain fp32 one (MKL) by PROBE_MARGIN at
    every row count of FP32_PROBE_ROWS on this CPU: probed once per process at the current thread
    count (an AVX2-only Zen 1 EPYC: 1.4-2.3x at 8 rows; see the module docstring)."""
    if not _FP32:
        _FP32.append(_probe_fp32())
    return _FP32[0]


def _best(f) -> float:
    f()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


def _probe_fp32() -> bool:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*PROBE_WEIGHT, generator=g)
    packed = prepack(w)
    with torch.inference_mode():
        for rows in FP32_PROBE_ROWS:
            x = torch.randn(rows, w.shape[1], generator=g)
            plain = _best(lambda x=x: F.linear(x, w))
            if _best(lambda x=x: packed_mm(x, packed)) * PROBE_MARGIN > plain:
                return False
    return True


def prepack(weight: torch.Tensor) -> torch.Tensor | VnniWeight:
    """[out, in] bf16 or fp32 weight -> a packed weight: mlakit's own layout for bf16 where `vnni_packs()`
    (a VnniWeight), else oneDNN's blocked layout (a torch._mkldnn tensor). Both have `to_dense()`."""
    with torch.no_grad():
        if weight.dtype == torch.bfloat16 and vnni_packs():
            return VnniWeight(weight)
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_mm(
    x: torch.Tensor, packed: torch.Tensor | VnniWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ Wᵀ (+ bias) with W prepacked (`prepack`); x [..., in] of the weight's dtype."""
    if isinstance(packed, VnniWeight):
        return packed.mm(x, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def upcast_rows() -> int | None:
    """Rows from which a product through fp32 (the packed weight unpacked and converted at each call,
    then MKL's fp32 GEMM) beats the packed bf16 one on this CPU, or None (never): probed once per
    process at the current thread count. Some CPUs run bf16 GEMMs slower than fp32 ones (an Intel Xeon
    with AVX512-BF16 but no AMX, one thread, 1,024 rows: packed bf16 ~76 GF/s, fp32 ~110-130 GF/s with
    the conversion); CPUs with AMX or Zen 4's bf16 units answer None."""
    if not _UPCAST:
        _UPCAST.append(_probe_upcast())
    return _UPCAST[0]


def _probe_upcast() -> int | None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*PROBE_WEIGHT, generator=g).to(torch.bfloat16)
    packed = prepack(w)
    with torch.inference_mode():
        wins = []
        for rows in PROBE_ROWS:
            x = torch.randn(rows, w.shape[1], generator=g).to(torch.bfloat16)
            bf16 = _best(lambda x=x: packed_mm(x, packed))
            fp32 = _best(lambda x=x: _upcast_mm(x, packed, None))
            wins.append(bf16 > PROBE_MARGIN * fp32)
    # the smallest probed row count from which fp32 wins at every larger one
    for i, rows in enumerate(PROBE_ROWS):
        if all(wins[i:]):
            return rows
    return None


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None, upcast: int | None = None
) -> torch.Tensor:
    """`packed_mm`, or through fp32 when x has at least `upcast` rows (see `upcast_rows`)."""
    if upcast is not None and x.numel() >= upcast * x.shape[-1]:
        return _upcast_mm(x, packed, bias)
    return packed_mm(x, packed, bias)


def _upcast_mm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = F.linear(x.float(), packed.to_dense().float(), None if bias is None else bias.float())
    return out.to(x.dtype)


class PackedLinear(nn.Module):
    """An inference-only nn.Linear whose bf16 or fp32 weight is prepacked; the bias (if any) stays a
    parameter. Inputs are of the weight's dtype."""

    def __init__(self, linear: nn.Linear, upcast: int | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.dtype = linear.weight.dtype
        if self.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"PackedLinear: weight must be bf16 or fp32, got {self.dtype}")
        # rows from which a bf16 product runs in fp32 (`upcast_rows`); None: never (always, for fp32)
        self.upcast = upcast if self.dtype == torch.bfloat16 else None
        # not a parameter or buffer: an opaque tensor has no storage to save or copy
        self.__dict__["packed"] = prepack(linear.weight)
        self.__dict__["_eager_key"] = compiled.register(self)

    @property
    def weight(self) -> torch.Tensor:
        """The plain [out, in] weight, rebuilt from the packed one (a new tensor each call)."""
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # dynamo cannot trace oneDNN's packed tensor: a compiled step calls the product as one op
        if torch.compiler.is_compiling():
            return compiled.opaque(self, [x], self.out_features)
        return self.eager(x)

    def eager(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype or x.device.type != "cpu":
            name = "bf16" if self.dtype == torch.bfloat16 else "fp32"
            raise ValueError(
                f"PackedLinear({self.in_features}, {self.out_features}): input must be {name} on the CPU "
                f"(the weight is prepacked for oneDNN), got {x.dtype} on {x.device}"
            )
        return packed_linear(x, self.packed, self.bias, self.upcast)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}, packed"


def pack_model(model: nn.Module) -> int:
    """Replace every plain CPU nn.Linear of `model` of the model's dtype (bf16, or fp32; see the module
    docstring for what is kept) by a PackedLinear and prepack every GroupedMoE's experts in place
    (GroupedMoE.pack(release=True)); returns the number of modules packed (linears and MoE blocks; 0
    where `packs` says no)."""
    from mlakit.engine.moe import GroupedMoE

    param = next(model.parameters(), None)
    if param is None or not packs(param.dtype, param.device):
        return 0
    owners: dict[int, int] = {}  # weight address -> modules holding it (a tied head: the embedding's)
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[p.data_ptr()] = owners.get(p.data_ptr(), 0) + 1
    grouped = [m for m in model.modules() if isinstance(m, GroupedMoE)]
    inside = {id(m) for g in grouped for m in g.modules()}  # the experts pack their shared MLP themselves
    swaps = []
    for parent in model.modules():
        if id(parent) in inside:
            continue
        for name, child in parent.named_children():
            if (
                type(child) in (nn.Linear, Linear)
                and name not in KEEP_PLAIN
                and child.weight.dtype == param.dtype
                and child.weight.device.type == "cpu"
                and owners[child.weight.data_ptr()] == 1
            ):
                swaps.append((parent, name, child))
    upcast = upcast_rows() if (swaps or grouped) and param.dtype == torch.bfloat16 else None
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child, upcast))
    return len(swaps) + sum(int(g.pack(release=True, upcast=upcast)) for g in grouped)


def unpack_model(model: nn.Module) -> int:
    """Undo `pack_model`: plain mlakit Linear modules and expert weights back; the number restored."""
    from mlakit.engine.moe import GroupedMoE

    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, PackedLinear)
    ]
    for parent, name, child in swaps:
        plain = Linear(child.in_features, child.out_features, bias=False, device="meta", dtype=child.dtype)
        plain.weight = nn.Parameter(child.weight, requires_grad=False)
        plain.bias = child.bias
        setattr(parent, name, plain)
    return len(swaps) + sum(int(g.unpack()) for g in model.modules() if isinstance(g, GroupedMoE))


def fuse_norms(model: nn.Module) -> int:
    """Replace the model's own RMSNorms (transformers' `*RMSNorm` modules with a `variance_epsilon`:
    weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)) by mlakit's RMSNorm on the same weight, whose bf16
    CPU forward is one pass per row (csrc/rows.cpp: 3-5x fewer microseconds; the squares summed in
    another order). Only bf16 weights on a CPU where the bf16 core runs, and only modules that compute
    the same on a random input (a variant such as weight + 1 stays as it is); returns how many."""
    from mlakit.attention import RMSNorm, _fused_norm

    swaps = []
    for parent in model.modules():
        for name, child in parent.named_children():
            weight = getattr(child, "weight", None)
            if (
                type(child).__name__.endswith("RMSNorm")
                and isinstance(getattr(child, "variance_epsilon", None), float)
                and isinstance(weight, nn.Parameter)
                and weight.dim() == 1
                and _fused_norm(weight.detach(), weight.detach())
            ):
                swaps.append((parent, name, child))
    done = 0
    g = torch.Generator().manual_seed(0)
    for parent, name, child in swaps:
        fused = RMSNorm(child.weight.shape[0], child.variance_epsilon, device="meta")
        fused.weight = child.weight
        x = torch.randn(4, child.weight.shape[0], generator=g).to(torch.bfloat16)
        with torch.no_grad():
            want, got = child(x).float(), fused(x).float()
        if (got - want).abs().max() <= 2**-7 * want.abs().max():
            setattr(parent, name, fused)
            done += 1
    return done
