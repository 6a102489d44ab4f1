"""The engine's MoE: grouped expert GEMMs over tokens sorted by expert, in place of transformers' block.

`install_moe(model)` swaps every MoE block of a served family (DeepSeek-V2, V3 / Kimi K2, V3.2, GLM-5
with DSA, GLM-4.7-Flash; MiniCPM3 is dense and has none) for a `GroupedMoE` holding the block's own
submodules under the same names (`gate`, `experts`, `shared_experts`): same parameters, same
state_dict keys, no weight copied. One step of a block:

- routing: the family's own router module is called (`mlp.gate(x)`), so V2's softmax with greedy /
  group-limited greedy top-k, V3's and GLM's sigmoid + `e_score_correction_bias` group-limited
  (`noaux_tc`) top-k, `norm_topk_prob` and `routed_scaling_factor` are exactly transformers' (`route`:
  the same ops without the group mask where it keeps every group);
- the N x k (token, expert) pairs are sorted by expert (stable), the rows gathered once, and each
  expert that has rows runs one GEMM for gate/up and one for down on its segment, straight on its
  slice of the stacked `experts.gate_up_proj` [E, 2I, D] / `experts.down_proj` [E, D, I] (views, no
  copy); an expert nobody picked costs nothing; the gate activation (`experts._apply_gate`) runs once
  over all segments;
- the shared experts run beside them: their rows go in front of the routed rows in the same output
  buffer (weight 1), and one weighted scatter-add (fp32 accumulation, as transformers' grouped path
  sums in fp32) gives every token shared + sum of its experts.

With `install_moe(model, pack=True)` bf16 experts also get a prepacked copy of their weights (oneDNN's
layout, or mlakit's own where `mlakit.ops.vnni.vnni_packs()`) for segments of at most PACKED_ROWS rows
(GroupedMoE.pack). Released packs in mlakit's layout (the engine's eager steps) run everything after the
router as one op (`moe_experts`, csrc/vnni_linear.cpp: the same products, SiLU gating and fp32 sums,
without a handful of small ops per expert: a demo block at 8 decode rows 1.63 -> 1.28 ms, one thread).
Under torch.compile the block takes a sync-free path (GroupedMoE._traced) so a fullgraph compiled step
can hold it. benchmarks/moe.py measures it against transformers' experts implementations ("eager",
"batched_mm", "grouped_mm", the last being transformers' default); docs/engine.md has the figures.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import SiLUActivation

from mlakit.engine import compiled
from mlakit.engine.packed import packed_linear, packs, prepack
from mlakit.linear import Linear
from mlakit.ops import vnni
from mlakit.ops.vnni import VnniWeight

try:  # transformers' default gating, act(gate) * up: the fused block computes only that one
    from transformers.integrations.moe import _default_apply_gate
except ImportError:
    _default_apply_gate = None

# transformers' MoE block classes the engine serves (all: gate -> (logits, weights, indices),
# experts with stacked gate_up_proj / down_proj, shared_experts an MLP)
MOE_BLOCKS = ("DeepseekV2Moe", "DeepseekV3MoE", "DeepseekV32MoE", "GlmMoeDsaMoE", "Glm4MoeLiteMoE")
MOE_IMPLS = ("grouped", "transformers")
# segments of at most this many rows use the prepacked bf16 weights (benchmarks/moe.py: no gain beyond)
PACKED_ROWS = 128
MLP_PROJ = ("gate_proj", "up_proj", "down_proj")
# routed rows weighted and summed at a time (256 x 1,024 fp32: 1 MB)
COMBINE_ROWS = 256
# transformers' sigmoid + `e_score_correction_bias` routers (`noaux_tc`), one forward shared by these
# families: `route` skips their group limit where it keeps every group (n_group == topk_group)
NOAUX_ROUTERS = (
    "DeepseekV3TopkRouter",
    "DeepseekV32TopkRouter",
    "GlmMoeDsaTopkRouter",
    "Glm4MoeLiteTopkRouter",
)


def _check_block(name: str, block: nn.Module) -> None:
    """ValueError naming the module when a block is not the layout GroupedMoE computes."""
    experts = getattr(block, "experts", None)
    why = None
    if not isinstance(getattr(block, "gate", None), nn.Module):
        why = "no gate (router) module"
    elif experts is None or not hasattr(experts, "gate_up_proj") or not hasattr(experts, "down_proj"):
        why = "no experts module with stacked gate_up_proj / down_proj"
    elif getattr(experts, "has_bias", False) or getattr(experts, "is_transposed", False):
        why = "experts with biases or transposed weights"
    elif not getattr(experts, "has_gate", True) or getattr(experts, "has_post_expert_norm", False):
        why = "experts without a gate or with a post-expert norm"
    elif getattr(experts, "_is_expert_parallel", False):
        why = "expert-parallel experts"
    elif not isinstance(getattr(block, "shared_experts", None), nn.Module):
        why = "no shared_experts module"
    if why is not None:
        raise ValueError(f"MoE block {name} ({type(block).__name__}): {why}; expected transformers' layout")


class GroupedMoE(nn.Module):
    """A transformers MoE block computed as grouped expert GEMMs (see the module docstring)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        import transformers.integrations.moe  # noqa: F401  (registers torch.ops.transformers.grouped_mm_fallback)

        self.config = block.config
        self.gate = block.gate
        self.experts = block.experts
        self.shared_experts = block.shared_experts
        self.__dict__["block"] = block  # transformers' own block, unregistered (no duplicate state_dict keys)
        self.__dict__["packed"] = None  # see pack()
        self.__dict__["released"] = False  # pack(release=True): the plain weights are meta tensors
        self.__dict__["upcast"] = None  # with released weights: rows from which segments run in fp32
        self.__dict__["_eager_key"] = compiled.register(self)

    def pack(self, release: bool = False, upcast: int | None = None) -> bool:
        """Prepack every expert's bf16 weights in oneDNN's blocked layout (built once; bit-identical products,
        ~1.5-2x faster on the few rows a decode step gives an expert). Only for bf16 on a CPU with native bf16
        oneDNN, or fp32 where `mlakit.engine.packed.packs` says so (products within fp32 rounding of
        torch.mm's); False (nothing packed) otherwise. Without `release` the packed weights are a second copy,
        repacked by themselves when the weights change in place or are replaced, and segments over PACKED_ROWS
        rows keep torch.mm. With `release=True` (the engine's eager steps) the packed weights replace the
        plain ones, which become meta tensors of the same shapes (memory neutral; every segment runs packed;
        `unpack()` restores them; torch.compile needs them plain). `upcast`: released segments of at least
        that many rows run through fp32 (mlakit.engine.packed.upcast_rows)."""
        if self.released:
            return True
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        mlp = self.shared_experts
        # bf16 where this CPU's oneDNN runs it natively (AVX2-only CPUs refuse the bf16 reorder), fp32
        # where the probe finds a gain
        ok = (
            packs(gate_up.dtype, gate_up.device)
            and all(type(getattr(mlp, n)) in (nn.Linear, Linear) for n in MLP_PROJ)
            and all(getattr(mlp, n).bias is None for n in MLP_PROJ)
        )
        if not ok:
            self.__dict__["packed"] = None
            return False
        with torch.no_grad():
            shared = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            packed = dict(
                key=self._weights_key(),
                shared_gate_up=prepack(shared),
                shared_down=prepack(mlp.down_proj.weight),
            )
            if isinstance(packed["shared_gate_up"], VnniWeight):
                # mlakit's layout: every expert's pack a slice of one stack, which `moe_experts` reads
                packed["stacks"] = (vnni.pack(gate_up.detach()), vnni.pack(down.detach()))
                packed["gate_up"] = [VnniWeight.wrap(w, *gate_up.shape[1:]) for w in packed["stacks"][0]]
                packed["down"] = [VnniWeight.wrap(w, *down.shape[1:]) for w in packed["stacks"][1]]
            else:
                packed["gate_up"] = [prepack(w) for w in gate_up.detach()]
                packed["down"] = [prepack(w) for w in down.detach()]
            self.__dict__["packed"] = packed
        if release:
            for owner, name in self._plain_weights():
                w = getattr(owner, name)
                setattr(owner, name, nn.Parameter(torch.empty_like(w, device="meta"), requires_grad=False))
            self.__dict__["released"] = True
            self.__dict__["upcast"] = upcast
        return True

    def unpack(self) -> bool:
        """Put plain weights back after `pack(release=True)` (rebuilt from the packed ones) and drop the
        packed copy; False when there was nothing released."""
        packed = self.packed
        if not self.released:
            return False
        with torch.no_grad():
            gate_up = torch.stack([p.to_dense() for p in packed["gate_up"]])
            down = torch.stack([p.to_dense() for p in packed["down"]])
            gate, up = (
                packed["shared_gate_up"]
                .to_dense()
                .split([self.shared_experts.gate_proj.out_features, self.shared_experts.up_proj.out_features])
            )
            plain = (gate_up, down, gate.contiguous(), up.contiguous(), packed["shared_down"].to_dense())
        for (owner, name), w in zip(self._plain_weights(), plain, strict=True):
            setattr(owner, name, nn.Parameter(w, requires_grad=False))
        self.__dict__["packed"] = None
        self.__dict__["released"] = False
        self.__dict__["upcast"] = None
        return True

    def _plain_weights(self) -> list[tuple[nn.Module, str]]:
        mlp = self.shared_experts
        return [
            (self.experts, "gate_up_proj"),
            (self.experts, "down_proj"),
            (mlp.gate_proj, "weight"),
            (mlp.up_proj, "weight"),
            (mlp.down_proj, "weight"),
        ]

    def _weights_key(self) -> tuple:
        mlp = self.shared_experts
        ts = (self.experts.gate_up_proj, self.experts.down_proj, mlp.gate_proj.weight, mlp.up_proj.weight)
        # inference tensors keep no version counter: their storage and dtype only
        ts = (*ts, mlp.down_proj.weight)
        return tuple((t.data_ptr(), None if t.is_inference() else t._version, t.dtype) for t in ts)

    def _shared(self, x: torch.Tensor, out: torch.Tensor, packed: dict | None) -> None:
        """The shared experts' MLP of every row of x, into out (their own forward when they have biases)."""
        mlp = self.shared_experts
        gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        if packed is not None and (self.released or x.shape[0] <= PACKED_ROWS):
            up = self.upcast
            h = packed_linear(x, packed["shared_gate_up"], upcast=up)
            g, u = h.chunk(2, dim=-1)
            out.copy_(packed_linear(mlp.act_fn(g) * u, packed["shared_down"], upcast=up))
        elif gate.bias is not None or up.bias is not None or down.bias is not None:
            out.copy_(mlp(x))
        else:
            h = mlp.act_fn(torch.mm(x, gate.weight.t())).mul_(torch.mm(x, up.weight.t()))
            torch.mm(h, down.weight.t(), out=out)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        weights, index = route(self.gate, x)  # [N, k] fp32, [N, k] long: the family's routing
        if torch.compiler.is_compiling():
            # prepacked experts: the router is traced, the expert GEMMs (segments sized by the routing)
            # run as one opaque op of a compiled step (mlakit/engine/compiled.py)
            if self.released:
                return compiled.opaque(self, [x, weights, index], x.shape[-1]).view(shape)
            return self._traced(x, weights, index).view(shape)
        return self.eager(x, weights, index).view(shape)

    def eager(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Shared + routed experts of rows x [N, D] routed to `index` [N, k] with `weights` [N, k]."""
        n, k = index.shape
        experts = self.experts
        gate_up, down = experts.gate_up_proj, experts.down_proj  # [E, 2I, D], [E, D, I]
        packed = self.packed
        if packed is not None and not self.released and packed["key"] != self._weights_key():
            self.pack()
            packed = self.packed
        if self._fused(packed, x):
            return self._fused_experts(x, weights, index, packed)
        limit, up = (n * k, self.upcast) if self.released else (PACKED_ROWS, None)
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
        token = torch.div(order, k, rounding_mode="floor")
        rows = x.index_select(0, token)  # [S, D], S = N * k, sorted by expert
        s = rows.shape[0]
        h = x.new_empty(s, gate_up.shape[1])
        start = 0
        for e, c in enumerate(counts):
            if c:
                end = start + c
                if packed is not None and c <= limit:
                    h[start:end] = packed_linear(rows[start:end], packed["gate_up"][e], upcast=up)
                else:
                    torch.mm(rows[start:end], gate_up[e].t(), out=h[start:end])
                start = end
        act = experts._apply_gate(h)  # [S, I]: act(gate) * up, transformers' own gating
        # rows [0, n): the shared experts of every token; rows [n, n + S): the routed pairs
        y = x.new_empty(n + s, x.shape[1])
        self._shared(x, y[:n], packed)
        start = 0
        for e, c in enumerate(counts):
            if c:
                end = start + c
                if packed is not None and c <= limit:
                    y[n + start : n + end] = packed_linear(act[start:end], packed["down"][e], upcast=up)
                else:
                    torch.mm(act[start:end], down[e].t(), out=y[n + start : n + end])
                start = end
        # shared + sum of the weighted routed rows, in fp32: the shared rows start the sums (weight 1,
        # exactly 0 + y), the routed rows are scaled and added COMBINE_ROWS at a time (a few small
        # temporaries in cache, not one [N * k, D] fp32 product; the same sums in the same order)
        scale = weights.reshape(-1).index_select(0, order)
        acc = y[:n].to(torch.promote_types(y.dtype, scale.dtype))
        for lo in range(0, s, COMBINE_ROWS):
            hi = min(s, lo + COMBINE_ROWS)
            acc.index_add_(0, token[lo:hi], y[n + lo : n + hi] * scale[lo:hi, None])
        return acc.to(x.dtype)

    def _fused(self, packed: dict | None, x: torch.Tensor) -> bool:
        """Whether one `moe_experts` call computes the block: released packs in mlakit's layout, no
        fp32 route, SiLU gating (transformers' default `_apply_gate`) in the experts and the shared MLP,
        even widths, bf16 rows."""
        if packed is None or "stacks" not in packed or not self.released or self.upcast is not None:
            return False
        mlp = self.shared_experts
        silu = (nn.SiLU, SiLUActivation)
        return (
            x.dtype == torch.bfloat16
            and _default_apply_gate is not None
            and type(self.experts)._apply_gate is _default_apply_gate
            and isinstance(self.experts.act_fn, silu)
            and isinstance(mlp.act_fn, silu)
            and x.shape[-1] % 2 == 0
            and self.experts.down_proj.shape[-1] % 2 == 0
            and mlp.down_proj.in_features % 2 == 0
        )

    def _fused_experts(self, x, weights, index, packed) -> torch.Tensor:
        """The whole block after routing in one op (csrc/vnni_linear.cpp: `moe_experts`): the same
        products, gating and fp32 sums in the same order as `eager`'s unfused path."""
        stacks = packed["stacks"]
        return torch.ops.mlakit_cpu.moe_experts(
            x.contiguous(),
            index.to(torch.long).contiguous(),
            weights.to(torch.float32).contiguous(),
            stacks[0],
            stacks[1],
            packed["shared_gate_up"].packed,
            packed["shared_down"].packed,
            self.experts.down_proj.shape[-1],
            self.shared_experts.down_proj.in_features,
        )

    def _traced(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The same sums with no host sync, for torch.compile(fullgraph=True): segment offsets stay a
        tensor and the segments run in transformers' opaque grouped-mm op (one torch.mm per expert
        segment); no prepacked weights."""
        if self.released:
            raise RuntimeError(
                "GroupedMoE: its weights are prepacked for eager steps (pack(release=True)); "
                "call unpack() before torch.compile"
            )
        n, k = index.shape
        experts = self.experts
        gate_up, down = experts.gate_up_proj, experts.down_proj
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(gate_up.shape[0], dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        token = torch.div(order, k, rounding_mode="floor")
        grouped_mm = torch.ops.transformers.grouped_mm_fallback
        h = grouped_mm(x.index_select(0, token), gate_up.transpose(1, 2), offsets)
        routed = grouped_mm(experts._apply_gate(h), down.transpose(1, 2), offsets)
        shared = x.new_empty(n, x.shape[1])
        self._shared(x, shared, None)
        y = torch.cat([shared, routed])
        scale = torch.cat([weights.new_ones(n), weights.reshape(-1).index_select(0, order)])
        target = torch.cat([torch.arange(n, device=x.device), token])
        acc = torch.zeros(n, x.shape[1], dtype=torch.promote_types(y.dtype, scale.dtype), device=x.device)
        return acc.index_add_(0, target, y * scale[:, None]).to(x.dtype)


def route(gate: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, k] fp32, experts [N, k] long) of rows x [N, D] by the family's router `gate`: its own
    forward, or, for a `noaux_tc` router (NOAUX_ROUTERS) whose group limit keeps every group
    (n_group == topk_group: Kimi K2, GLM-4.7-Flash, the demo model), the same ops without the group
    mask (all true there: masked_fill changes nothing, the top-k sees the same scores). Identical
    results, a dozen small ops fewer per block (the demo's router alone at 32 rows, AMD EPYC Zen 4:
    82-98 -> 50-52 us). Whether a router class computes what `_short_route` does is checked once, on
    random rows against its own forward (another transformers version may route otherwise)."""
    if short_route(gate):
        return _short_route(gate, x)
    _, weights, index = gate(x)
    return weights, index


def short_route(gate: nn.Module) -> bool:
    """Whether `route` takes `gate` through `_short_route` (checked once per router class)."""
    kind = type(gate)
    if kind.__name__ in NOAUX_ROUTERS and getattr(gate, "num_group", None) == getattr(gate, "topk_group", 0):
        known = _SHORT_ROUTES.get(kind)
        if known is None and not torch.compiler.is_compiling() and not gate.weight.is_meta:
            known = _SHORT_ROUTES[kind] = _same_routing(gate)
        return bool(known)
    return False


# router class -> whether `_short_route` gives its forward's results (checked once, by `_same_routing`)
_SHORT_ROUTES: dict[type, bool] = {}


def _short_route(gate: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(x.view(-1, gate.hidden_dim).type(torch.float32), gate.weight.type(torch.float32))
    scores = logits.sigmoid()
    index = torch.topk(scores + gate.e_score_correction_bias, k=gate.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, index)
    if gate.norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
    return weights * gate.routed_scaling_factor, index


def _same_routing(gate: nn.Module) -> bool:
    """Whether `_short_route` equals the router's own forward, bit for bit, on 64 random rows."""
    try:
        w = gate.weight
        g = torch.Generator(device=w.device).manual_seed(0)
        x = torch.randn(64, gate.hidden_dim, generator=g, device=w.device).to(w.dtype)
        with torch.no_grad():
            _, want_w, want_i = gate(x)
            got_w, got_i = _short_route(gate, x)
        return torch.equal(got_i, want_i) and torch.equal(got_w, want_w)
    except Exception:  # attributes this version lacks: the router's own forward
        return False


def install_moe(model: nn.Module, impl: str = "grouped", pack: bool = False) -> int:
    """Swap every served MoE block of `model` for a GroupedMoE (impl="grouped") or put transformers'
    own blocks back (impl="transformers"); the number of blocks that run grouped afterwards (0 for a
    dense family such as MiniCPM3, or for impl="transformers"). `pack=True` also prepacks bf16 expert
    weights for oneDNN where the CPU build has it (GroupedMoE.pack: a second copy of every expert's
    weights, ~1.1-1.2x on the block at 32-128 tokens in benchmarks/moe.py); the default keeps one copy
    and runs every segment on torch.mm. Every block is checked before any is swapped:
    a refusal is a ValueError and leaves the model as it was."""
    if impl not in MOE_IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {', '.join(map(repr, MOE_IMPLS))}")
    if not isinstance(pack, bool):
        raise ValueError(f"pack={pack!r}: expected True or False")
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    swaps = []
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if impl == "grouped" and type(child).__name__ in MOE_BLOCKS:
                _check_block(name, child)
                swaps.append((parent, child_name, GroupedMoE(child)))
            elif impl == "transformers" and isinstance(child, GroupedMoE):
                swaps.append((parent, child_name, child.block))
    for parent, child_name, module in swaps:
        old = getattr(parent, child_name)
        if isinstance(old, GroupedMoE):
            old.unpack()  # the block's modules hold plain weights again
        setattr(parent, child_name, module)
    grouped = [m for m in model.modules() if isinstance(m, GroupedMoE)]
    for m in grouped:
        if pack:
            m.pack()
        else:
            m.unpack()
            m.__dict__["packed"] = None
    return len(grouped)
