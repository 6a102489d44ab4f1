"""LatentCache: per slot, the normalized latent and the rotated rope key of every cached token."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mlakit.config import MLAConfig

Slots = torch.Tensor | Sequence[int] | None


class LatentCache:
    """Contiguous slots of `max_seq_len` tokens: `c_kv [batch, max_seq_len, L]`, `k_pe [.., dr]`.

    The latent and the rope key are kept in two tensors so that both score matmuls and the value-side
    matmul of absorb read rows with unit stride. `lengths` (a CPU LongTensor) counts the tokens of each
    slot; lowering it drops the newest tokens (what a rejected speculative draft does).
    """

    def __init__(
        self,
        cfg: MLAConfig,
        batch_size: int,
        max_seq_len: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        for name, value in (("batch_size", batch_size), ("max_seq_len", max_seq_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.cfg = cfg
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.c_kv = torch.zeros(batch_size, max_seq_len, cfg.kv_lora_rank, dtype=dtype, device=device)
        self.k_pe = torch.zeros(batch_size, max_seq_len, cfg.qk_rope_head_dim, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long)

    @property
    def dtype(self) -> torch.dtype:
        return self.c_kv.dtype

    @property
    def device(self) -> torch.device:
        return self.c_kv.device

    @property
    def bytes_per_token(self) -> int:
        """Bytes stored per token per layer."""
        return self.cfg.latent_dim * self.c_kv.element_size()

    def resolve_slots(self, slots: Slots, rows: int) -> torch.Tensor:
        """Check `slots` for `rows` batch rows (default: row b → slot b); a CPU LongTensor [rows]."""
        if slots is None:
            if rows > self.batch_size:
                raise ValueError(f"batch of {rows} rows without slots, but the cache has {self.batch_size}")
            return torch.arange(rows)
        s = torch.as_tensor(slots).to("cpu").reshape(-1)
        if s.dtype.is_floating_point or s.dtype == torch.bool:
            raise ValueError(f"slots must be integers, got dtype {s.dtype}")
        s = s.long()
        if s.numel() != rows:
            raise ValueError(f"slots has {s.numel()} entries, expected one per batch row ({rows})")
        if s.numel() and (s.min() < 0 or s.max() >= self.batch_size):
            raise ValueError(f"slots {s.tolist()} out of range, expected 0..{self.batch_size - 1}")
        if torch.unique(s).numel() != s.numel():
            raise ValueError(f"slots {s.tolist()} has duplicates; each row needs its own slot")
        return s

    def check_append(self, new_tokens: int | torch.Tensor, slots: torch.Tensor) -> None:
        """Raise before any write if `new_tokens` (one count or one per row) do not fit in `slots`."""
        counts = row_counts(new_tokens, slots.numel())
        after = self.lengths[slots] + counts
        over = after > self.max_seq_len
        if bool(over.any()):
            bad = slots[over].tolist()
            shown = new_tokens if isinstance(new_tokens, int) else counts[over].tolist()
            raise ValueError(
                f"appending {shown} tokens overflows slots {bad}: lengths "
                f"{self.lengths[slots][over].tolist()} + {shown} > max_seq_len {self.max_seq_len}"
            )

    def check_lengths(self) -> None:
        if bool((self.lengths < 0).any()) or bool((self.lengths > self.max_seq_len).any()):
            raise ValueError(f"cache lengths {self.lengths.tolist()} outside 0..{self.max_seq_len}")

    def append(self, c_kv: torch.Tensor, k_pe: torch.Tensor, slots: Slots = None) -> torch.Tensor:
        """Write normalized latents [B,S,L] and rotated rope keys [B,S,dr]; returns the slots used."""
        cfg = self.cfg
        if c_kv.dim() != 3 or k_pe.dim() != 3:
            raise ValueError(
                f"c_kv and k_pe must be [B,S,width], got {tuple(c_kv.shape)} and {tuple(k_pe.shape)}"
            )
        b, s, width = c_kv.shape
        if width != cfg.kv_lora_rank:
            raise ValueError(f"c_kv has width {width}, cache expects kv_lora_rank {cfg.kv_lora_rank}")
        if tuple(k_pe.shape) != (b, s, cfg.qk_rope_head_dim):
            raise ValueError(f"k_pe has shape {tuple(k_pe.shape)}, expected {(b, s, cfg.qk_rope_head_dim)}")
        for name, t in (("c_kv", c_kv), ("k_pe", k_pe)):
            if t.dtype != self.dtype:
                raise ValueError(f"{name} has dtype {t.dtype}, cache holds {self.dtype}")
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}, cache is on {self.device}")
        self.check_lengths()
        slot_ids = self.resolve_slots(slots, b)
        self.check_append(s, slot_ids)
        self._write(c_kv, k_pe, slot_ids)
        return slot_ids

    def _write(self, c_kv: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor) -> None:
        s = c_kv.shape[1]
        start = self.lengths[slots]
        pos = (start[:, None] + torch.arange(s)).to(self.device)  # [B, S]
        rows = slots.to(self.device)[:, None].expand_as(pos)
        with torch.no_grad():
            self.c_kv[rows, pos] = c_kv.detach()
            self.k_pe[rows, pos] = k_pe.detach()
        self.lengths[slots] = start + s

    def release(self, slot: int) -> None:
        """Empty `slot` for reuse."""
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.batch_size:
            raise ValueError(f"slot {slot!r} out of range, expected 0..{self.batch_size - 1}")
        self.lengths[slot] = 0

    def view(self, slots: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(c_kv [B, max_len, L], k_pe [B, max_len, dr]) of `slots`; no copy when slots are consecutive."""
        first = int(slots[0])
        consecutive = bool((slots == torch.arange(first, first + slots.numel())).all())
        if consecutive:
            return (
                self.c_kv[first : first + slots.numel(), :max_len],
                self.k_pe[first : first + slots.numel(), :max_len],
            )
        idx = slots.to(self.device)
        return self.c_kv[idx, :max_len], self.k_pe[idx, :max_len]


def row_counts(new_tokens: int | torch.Tensor, rows: int) -> torch.Tensor:
    """New tokens per row as a CPU LongTensor [rows], from one count for all rows or one per row (>= 1)."""
    if isinstance(new_tokens, torch.Tensor):
        counts = new_tokens.to("cpu", torch.long).reshape(-1)
        if counts.numel() != rows:
            raise ValueError(
                f"new token counts {counts.tolist()} have {counts.numel()} entries, expected {rows}"
            )
    else:
        counts = torch.full((rows,), int(new_tokens), dtype=torch.long)
    if bool((counts <= 0).any()):
        shown = new_tokens if isinstance(new_tokens, int) else counts.tolist()
        raise ValueError(f"appending {shown} tokens; expected at least 1")
    return counts
