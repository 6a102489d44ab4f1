"""ModelRunner: the only part of the engine that holds tensors.

The model runs its own modules (embeddings, norms, MLP/MoE, lm_head, every family's scales), its
attention modules replaced by `EngineAttention`: mlakit `MLAAttention` layers sharing the original
weights, all reading one `StepPlan` over one `PagedLatentCache`. Eager steps of DeepSeek-V2, V3 / Kimi K2
and GLM-4.7-Flash call those modules through the engine's decoder loop (mlakit/engine/loop.py), the other
families through the model's transformers forward. The step's tokens are packed end to end ([N, D]
through the loop's layers, [1, N, D] through the model's, [N, D] into each attention; N the real token
count, in the plan's row order: decode -> extend -> prefill); no padding anywhere. The forward hands
back the final hidden states of the rows the engine keeps (the model's lm_head is skipped); the runner
applies the head itself, a slice of rows at a time, so prompt log-probabilities over a whole chunk stay
bounded. The same forward runs eager or, for the token-count buckets `enable_compile` is given,
compiled (mlakit/engine/compiled.py; the engine chooses at start, mlakit/engine/warmup.py).
"""

from __future__ import annotations

import types

import torch
from torch import nn

from mlakit.attention import MLAAttention
from mlakit.config import MLAConfig
from mlakit.engine import compiled
from mlakit.engine.loop import DecoderLoop
from mlakit.engine.moe import install_moe
from mlakit.engine.packed import fuse_norms, pack_model

# rows of logits materialized at a time for prompt log-probabilities: 256 x 129,280 (DeepSeek-V3's
# vocabulary) fp32 is 132 MB, where a 2,048-token chunk at once would be 1.06 GB
LOGPROB_ROWS = 256
# eager bf16 CPU steps run their GEMMs on oneDNN-prepacked weights (mlakit/engine/packed.py); tests
# turn it off to compare
PACK = True

# attention classes the engine serves (transformers' names); every other MLA family is refused by name
ENGINE_ATTENTION = (
    "DeepseekV3Attention",
    "DeepseekV32Attention",
    "GlmMoeDsaAttention",
    "Glm4MoeLiteAttention",
    "MiniCPM3Attention",
    "DeepseekV2Attention",
)


class StepContext:
    """What every EngineAttention of one step reads (set by the runner before the forward)."""

    plan = None


class EngineAttention(nn.Module):
    """A transformers attention slot holding an mlakit layer; returns what the decoder layer unpacks."""

    def __init__(self, mla: MLAAttention, ctx: StepContext, returns_indices: bool):
        super().__init__()
        self.mla = mla
        self.ctx = ctx
        self.returns_indices = returns_indices
        self.__dict__["_eager_key"] = compiled.register(self)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        x = hidden_states.view(-1, hidden_states.shape[-1])
        # a compiled step calls the layer as one opaque op: it reads the plan and writes the cache
        out = compiled.opaque(self, [x], x.shape[-1]) if torch.compiler.is_compiling() else self.eager(x)
        out = out.view(hidden_states.shape)
        return (out, None, None) if self.returns_indices else (out, None)

    def eager(self, x: torch.Tensor) -> torch.Tensor:
        plan = self.ctx.plan
        if plan is None:
            raise RuntimeError(
                "this model belongs to an mlakit.engine LLM/LLMEngine (its attention reads the engine's "
                "paged cache): generate through the engine, or pass a copy (copy.deepcopy) to keep one "
                "for transformers"
            )
        return self.mla(x, plan)


def check_family(model: nn.Module) -> tuple[MLAConfig, list[nn.Module]]:
    """(MLAConfig, the decoder layers) of a model the engine serves; ValueError naming the family else."""
    from mlakit.hf.families import FAMILIES

    layers = getattr(getattr(model, "model", None), "layers", None)
    name = type(model).__name__
    if layers is None or len(layers) == 0:
        raise ValueError(f"model {name} has no decoder layers (model.model.layers); expected a causal LM")
    kinds = {type(layer.self_attn).__name__ for layer in layers}
    for kind in kinds:
        if kind not in ENGINE_ATTENTION:
            why = FAMILIES[kind].refused if kind in FAMILIES else "not an MLA attention"
            raise ValueError(
                f"model family {name} (attention {kind}) is not served by mlakit.engine: "
                f"{why or 'not supported by the engine yet'}; served: {', '.join(ENGINE_ATTENTION)}"
            )
    for layer in layers:
        if hasattr(layer.self_attn, "indexer") and layer.self_attn.indexer is None:
            raise ValueError(
                f"model family {name}: layers that share the previous layer's top-k (index_topk_pattern) "
                "are not served by mlakit.engine yet"
            )
    return MLAConfig.from_hf(model.config), list(layers)


class ModelRunner:
    """Runs one planned step of `model`; hidden states of the kept rows -> logits, log-probabilities."""

    def __init__(self, model: nn.Module):
        self.model = model.eval()
        self.cfg, layers = check_family(model)
        self.head = getattr(model, "lm_head", None)
        if not isinstance(self.head, nn.Module):
            raise ValueError(f"model {type(model).__name__} has no lm_head module; expected a causal LM")
        self._through = nn.Identity()
        self.ctx = StepContext()
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.layers = []
        for i, layer in enumerate(layers):
            original = layer.self_attn
            mla = MLAAttention(self.cfg, layer_idx=i, device="meta", dtype=self.dtype)
            mla.load_state_dict(original.state_dict(), strict=True, assign=True)
            mla.eval()
            returns = type(original).__name__ == "GlmMoeDsaAttention"
            layer.self_attn = EngineAttention(mla, self.ctx, returns)
            self.layers.append(mla)
        self.moe_blocks = install_moe(model)
        # linears and experts prepacked where bf16 runs natively on this CPU (0: none, plain GEMMs)
        self.packed_modules = pack_model(model) if PACK else 0
        if self.packed_modules:  # the absorbed folds' per-head products on packed copies of kv_b_proj
            for mla in self.layers:
                mla.pack_up()
            fuse_norms(model)
        self.head = model.lm_head
        # the decoder loop without transformers' model code, for the families whose forward it is
        self.loop = DecoderLoop.build(model, self.layers)
        self.vocab_size = model.config.vocab_size
        self._mask = torch.zeros(1, 1, 1, 1, dtype=self.dtype, device=self.device)
        # the compiled step (mlakit/engine/compiled.py): token-count buckets, those that run compiled,
        # and the last step's mode
        self.buckets: tuple = ()
        self.compiled_buckets: set[int] = set()
        self._compiled = None
        self.last_mode = "eager"
        self.compiled_steps = 0  # steps run compiled (warm-up steps included)
        # engine warm-up: {"reps": r, "times": {bucket: {...}}} makes each step time both modes
        self.probe: dict | None = None

    def enable_compile(self, buckets, backend: str = "inductor", options: dict | None = None) -> None:
        """Compile the forward (lazily, per bucket on its first step) for `buckets` [(lo, hi), ...]; every
        bucket runs compiled until `compiled_buckets` says otherwise."""
        self.buckets = tuple(buckets)
        self.compiled_buckets = set(range(len(self.buckets)))
        kw = {} if backend != "inductor" else {"options": dict(options or {})}
        # dynamo keeps its graphs (and their count limit) per code object: one of its own per runner, so
        # that engines of other models in the process neither guard-fail into nor use up this one's
        code = ModelRunner._all_rows.__code__.replace(co_name=f"_all_rows_{compiled.new_key()}")
        fn = types.FunctionType(code, ModelRunner._all_rows.__globals__, code.co_name)
        self._compiled = torch.compile(types.MethodType(fn, self), backend=backend, **kw)

    def compiled_ranges(self) -> tuple[str, ...]:
        """The token counts whose steps run compiled: "1", "2-16", ..."""
        spans = (self.buckets[b] for b in sorted(self.compiled_buckets))
        return tuple(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in spans)

    def disable_compile(self) -> None:
        self.buckets, self.compiled_buckets, self._compiled, self.probe = (), set(), None, None

    def _all_rows(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # logits_to_keep=0: every row, so the kept rows' count stays out of the graph
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=self._mask,
            use_cache=False,
            logits_to_keep=0,
        )
        return out.logits[0]

    @torch.inference_mode()
    def forward(self, plan, ids: list[int], positions: list[int], keep: list[int]):
        """Hidden states [len(keep), D] (model dtype) of the packed tokens at `keep` after one step of the
        plan (`ids`, `positions`: its tokens in the plan's order): what the lm_head would read (the
        model's final norm and its family's scale applied)."""
        bucket = compiled.bucket_of(len(ids), self.buckets) if self._compiled is not None else None
        self.ctx.plan = plan
        # every served family's last op is `lm_head(hidden[:, keep])`: skipped here, applied by `logits`
        self.model.lm_head = self._through
        try:
            if self.probe is not None and bucket is not None:
                return self._probe(ids, positions, keep, bucket)
            if bucket in self.compiled_buckets:
                self.last_mode = "compiled"
                self.compiled_steps += 1
                return self._run_compiled(ids, positions, keep, bucket)
            self.last_mode = "eager"
            return self._run_eager(ids, positions, keep)
        finally:
            self.model.lm_head = self.head
            self.ctx.plan = None

    def _run_eager(self, ids: list[int], positions: list[int], keep: list[int]):
        dev = self.device
        if self.loop is not None and not self.loop.hooked():
            ids_t = torch.tensor(ids, dtype=torch.long, device=dev)
            return self.loop(self.ctx.plan, ids_t, torch.tensor(keep, dtype=torch.long, device=dev))
        out = self.model(
            input_ids=torch.tensor([ids], dtype=torch.long, device=dev),
            position_ids=torch.tensor([positions], dtype=torch.long, device=dev),
            # a 4D mask makes transformers skip building one; the mlakit layers mask by the plan
            attention_mask=self._mask,
            use_cache=False,
            logits_to_keep=torch.tensor(keep, dtype=torch.long, device=dev),
        )
        return out.logits[0]

    def _probe(self, ids: list[int], positions: list[int], keep: list[int], bucket: int):
        """One warm-up step: compiled first (the compile), then eager and compiled in turn on the same
        plan (a layer may rewrite its rows), best seconds of each into `probe["times"][bucket]`."""
        import time

        t0 = time.perf_counter()
        got = self._run_compiled(ids, positions, keep, bucket)
        first = time.perf_counter() - t0
        best = {"eager": float("inf"), "compiled": float("inf")}
        for _ in range(self.probe["reps"]):
            for mode, run in (("eager", self._run_eager), ("compiled", self._run_compiled)):
                t0 = time.perf_counter()
                run(ids, positions, keep, *((bucket,) if mode == "compiled" else ()))
                best[mode] = min(best[mode], time.perf_counter() - t0)
        self.probe["times"][bucket] = dict(best, first=first)
        self.last_mode = "compiled"
        return got

    def _run_compiled(self, ids: list[int], positions: list[int], keep: list[int], bucket: int):
        dev = self.device
        ids_t = torch.tensor([ids], dtype=torch.long, device=dev)
        pos_t = torch.tensor([positions], dtype=torch.long, device=dev)
        lo, hi = self.buckets[bucket]
        if lo != hi:  # one graph for the bucket: its token count a dynamic size within [lo, hi]
            for t in (ids_t, pos_t):
                torch._dynamo.mark_dynamic(t, 1, min=lo, max=hi)
        hidden = self._compiled(ids_t, pos_t)  # [N, D]
        return hidden.index_select(0, torch.tensor(keep, dtype=torch.long, device=dev))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """[M, D] -> [M, V] fp32 (fp32=False: in the head's own dtype, for `sample` to widen as it reads)."""
        out = self.head(hidden)
        return out.float() if fp32 else out

    @torch.inference_mode()
    def token_logprobs(self, hidden: torch.Tensor, targets: list[int], k: int):
        """Log-probabilities of `targets` under each row's distribution, and each row's top-k: lists of
        R floats, R lists of k floats, R lists of k ids, computed LOGPROB_ROWS rows at a time."""
        chosen, values, indices = [], [], []
        target = torch.tensor(targets, dtype=torch.long, device=hidden.device)
        for lo in range(0, hidden.shape[0], LOGPROB_ROWS):
            lp = self.logits(hidden[lo : lo + LOGPROB_ROWS]).log_softmax(-1)  # [r, V]
            chosen += lp.gather(1, target[lo : lo + LOGPROB_ROWS, None])[:, 0].tolist()
            if k:
                top = lp.topk(min(k, lp.shape[-1]), dim=-1)
                values += top.values.tolist()
                indices += top.indices.tolist()
        if not k:
            values = indices = [[] for _ in targets]
        return chosen, values, indices
