"""What every backend of one run shares: the config, dtype, device, the layers' weights and the inputs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mlakit.attention import MLAAttention
from mlakit.bench.grid import Cell
from mlakit.bench.kv import KVWeights
from mlakit.bench.layers import BenchLayer
from mlakit.config import MLAConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype}")


@dataclass
class CellInputs:
    hidden: torch.Tensor  # [B, S, D]: the step's new tokens
    c_kv: torch.Tensor  # [B, T, L]: cached normalized latents
    k_pe: torch.Tensor  # [B, T, dr]: cached rotated rope keys


@dataclass
class BenchContext:
    cfg: MLAConfig
    dtype: torch.dtype
    device: torch.device
    seed: int = 0
    layer: BenchLayer = field(init=False)
    sparse_cfg: MLAConfig | None = field(default=None, init=False)  # the DSA config, for mlakit-sparse
    _hf: object = field(default=None, init=False, repr=False)
    _sparse: MLAAttention | None = field(default=None, init=False, repr=False)
    _kv: KVWeights | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        dtype_name(self.dtype)
        torch.manual_seed(self.seed)
        # dense MLA at the model's widths (what transformers' baseline loads); a DSA model's own layer,
        # indexer included, is `sparse_layer()` (the mlakit-sparse backend)
        self.sparse_cfg = self.cfg if self.cfg.is_sparse else None
        self.cfg = self.cfg.dense()
        self.layer = BenchLayer(self.cfg, dtype=self.dtype, device=self.device).eval()

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    def hf_layer(self):
        """transformers' layer on the same weights, built on first use."""
        if self._hf is None:
            from mlakit.bench.hf_layer import HFLayer

            self._hf = HFLayer(self.layer)
        return self._hf

    def sparse_layer(self) -> MLAAttention:
        """The DSA layer on the dense layer's weights plus its own indexer, built on first use."""
        if self.sparse_cfg is None:
            raise ValueError(f"model {self.cfg.name!r} has no indexer: mlakit-sparse needs a DSA model")
        if self._sparse is None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed + 1)
                layer = MLAAttention(self.sparse_cfg, dtype=self.dtype, device=self.device).eval()
            missing, unexpected = layer.load_state_dict(self.layer.state_dict(), strict=False)
            if unexpected or any(not k.startswith("indexer.") for k in missing):
                raise ValueError(f"sparse layer weights differ from the dense: {missing}, {unexpected}")
            layer.profile = self.layer.profile
            self._sparse = layer
        return self._sparse

    def kv_weights(self) -> KVWeights:
        if self._kv is None:
            cfg = self.cfg
            self._kv = KVWeights.random(
                cfg.hidden_size,
                cfg.num_heads,
                cfg.v_head_dim,
                dtype=self.dtype,
                device=self.device,
                seed=self.seed,
            )
        return self._kv

    def generator(self, cell: Cell, salt: int = 0) -> torch.Generator:
        """A CPU generator fixed by the seed and the cell: every backend of a cell sees equal inputs."""
        key = ((self.seed * 1_000_003 + cell.batch) * 1_000_003 + cell.cached) * 1_000_003 + cell.new
        return torch.Generator().manual_seed((key * 31 + salt) % (1 << 63))

    def randn(self, *shape: int, gen: torch.Generator) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=self.device, dtype=self.dtype)

    def inputs(self, cell: Cell) -> CellInputs:
        cfg, gen = self.cfg, self.generator(cell)
        return CellInputs(
            hidden=self.randn(cell.batch, cell.new, cfg.hidden_size, gen=gen),
            c_kv=self.randn(cell.batch, cell.cached, cfg.kv_lora_rank, gen=gen),
            k_pe=self.randn(cell.batch, cell.cached, cfg.qk_rope_head_dim, gen=gen),
        )
