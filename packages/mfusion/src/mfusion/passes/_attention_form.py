"""The two forms the ``attention`` pass chooses between, built on random inputs for timing.

The candidate is the CPU flash kernel as the rewrite emits it (grouped K/V where the rewrite
passes them ungrouped, ``is_causal`` where the mask is the causal one). The baseline is what the
graph runs without the rewrite: Inductor's compiled ``bmm -> scale -> (+ mask) -> softmax ->
bmm`` (the fp32 softmax round trip for low precision, the K/V repeat for grouped heads),
compiled on its first call so that a test's fake timer never pays for the compile.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from npu_core.timing import Call

CACHE_KIND = "attention"
"""The flash-or-not decisions' folder under ``$MFUSION_CACHE_DIR``."""

LABELS = ("flash", "bmm + softmax + bmm")

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BLOCKED = -1e30
_SCALE = 0.125


@dataclasses.dataclass(frozen=True)
class AttentionForm:
    """One attention as the pass found it: everything its timing depends on."""

    dtype: torch.dtype
    query: tuple[int, int, int, int]
    """``[B, H, L, E]``."""
    keys: int
    value_dim: int
    mask: tuple[int, ...] | None
    """The additive mask's shape (broadcast to ``[B, H, L, S]``); None without a mask."""
    causal: bool
    """The mask is the causal one: flash runs with ``is_causal`` and no mask."""
    n_rep: int
    """Query heads per K/V head the kernel receives (1: K/V repeated in the graph)."""
    low_precision_softmax: bool
    """The softmax runs in fp32 and is cast back (transformers' form for bf16)."""

    def fields(self) -> dict[str, object]:
        """The cache key's part beyond the machine profile."""
        return {
            "dtype": str(self.dtype),
            "query": list(self.query),
            "keys": self.keys,
            "value_dim": self.value_dim,
            "mask": list(self.mask) if self.mask is not None else None,
            "causal": self.causal,
            "n_rep": self.n_rep,
            "low_precision_softmax": self.low_precision_softmax,
        }

    def describe(self) -> str:
        b, h, length, e = self.query
        return f"{self.dtype} attention [{b}, {h}, {length}, {e}] over {self.keys} keys"

    def _inputs(self) -> list[torch.Tensor]:
        b, h, length, e = self.query
        generator = torch.Generator().manual_seed(0)
        kv_heads = h // self.n_rep

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=generator).to(self.dtype)

        inputs = [randn(b, h, length, e), randn(b, kv_heads, self.keys, e)]
        inputs.append(randn(b, kv_heads, self.keys, self.value_dim))
        if self.mask is not None:
            mask = torch.zeros(self.mask)
            if self.causal:
                blocked = torch.ones(length, self.keys, dtype=torch.bool).triu(1)
                mask = mask.masked_fill(blocked, _BLOCKED)
            inputs.append(mask.to(self.dtype))
        return inputs

    def _unfused(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *mask: torch.Tensor
    ) -> torch.Tensor:
        """The graph's own form, as traced and compiled by Inductor."""
        if self.n_rep > 1:
            k, v = (t.repeat_interleave(self.n_rep, dim=1) for t in (k, v))
        scores = torch.matmul(q, k.transpose(2, 3)) * _SCALE
        if mask:
            scores = scores + mask[0]
        if self.low_precision_softmax:
            probs = torch.softmax(scores.float(), dim=-1).to(self.dtype)
        else:
            probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, v)

    def calls(self) -> tuple[Call, Call]:
        """(flash, Inductor's unfused form) on random inputs of this form's shapes and dtype."""
        from torch._inductor.decomposition import select_decomp_table
        from torch.fx.experimental.proxy_tensor import make_fx

        from mfusion.mlir.standalone import inductor_compiled

        inputs = self._inputs()
        q, k, v = inputs[:3]
        mask = None if self.causal or self.mask is None else inputs[3]
        gm = make_fx(self._unfused, decomposition_table=select_decomp_table())(*inputs)

        @functools.cache
        def compiled() -> Call:
            return inductor_compiled(gm, inputs)  # type: ignore[no-any-return]

        def flash() -> object:
            return _FLASH(q, k, v, 0.0, self.causal, attn_mask=mask, scale=_SCALE)

        return flash, lambda: compiled()(*inputs)
