"""Block geometry and input checks shared by the sparse-attention kernels and the selection."""

from __future__ import annotations

import torch

BlockSize = int | tuple[int, int]


def block_shape(block_size: BlockSize) -> tuple[int, int]:
    """(query block, key block) tokens from ``block_size``: an int for square blocks, or a pair.

    Raises:
        ValueError: not a positive int or a pair of them.
    """
    pair = (block_size, block_size) if isinstance(block_size, int) else block_size
    # isinstance with a tuple, not ``tuple | list``: torch 2.9's Dynamo (our floor) cannot wrap a
    # types.UnionType and breaks the graph here (these checks run inside traced attention).
    if not (
        isinstance(pair, (tuple, list))
        and len(pair) == 2
        and all(isinstance(x, int) and x >= 1 for x in pair)
    ):
        raise ValueError(
            f"block_size={block_size!r} must be a positive int or a (query, key) pair of them"
        )
    return (pair[0], pair[1])


def block_index_to_dense(block_index: torch.Tensor, num_kv_blocks: int) -> torch.Tensor:
    """Boolean block mask [B, N, nq, nk] from a -1 padded index list [B, N, nq, K]."""
    valid = block_index >= 0
    dense = torch.zeros(
        (*block_index.shape[:-1], num_kv_blocks + 1), dtype=torch.bool, device=block_index.device
    )
    # Padding (-1) is routed to an extra column that is dropped afterwards.
    target = torch.where(valid, block_index, num_kv_blocks).long()
    dense.scatter_(-1, target, True)
    return dense[..., :num_kv_blocks]


def check_same_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise a ValueError naming the shapes when BNSD q, k, v differ in batch or head count."""
    if k.shape[:2] != q.shape[:2] or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"q, k, v must share batch and head counts; got {tuple(q.shape[:2])}, "
            f"{tuple(k.shape[:2])}, {tuple(v.shape[:2])}"
        )


_SPARSE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_qkv(q: object, k: object, v: object, layout: str, *, same_tokens: bool = True) -> None:
    """Refuse q, k, v that no kernel can take, naming the argument, its shape and the rule.

    One check for every kernel and every sparsity, run before any work: without it the dense
    route (sparsity 0) and the sparse route failed differently on the same bad input (raw
    ``IndexError`` for a 3-D tensor, an integer result for integer inputs, the latent shape
    blamed for a q/k length mismatch).

    Args:
        q, k, v: expected 4-D floating tensors on one device, [B, N, S, D] ("BNSD") or
            [B, S, N, D] ("BSND"), with equal B, N, S and q/k head dims.
        layout: the layout the caller declared (already validated).
        same_tokens: q must have k's token count (self-attention); k and v always match.

    Raises:
        TypeError: an argument is not a tensor.
        ValueError: a dimension count, dtype, device, batch, head count, length or head dim
            that does not fit.
    """
    dims = "[B, N, S, D]" if layout == "BNSD" else "[B, S, N, D]"
    for name, arg in {"q": q, "k": k, "v": v}.items():
        if not isinstance(arg, torch.Tensor):
            raise TypeError(f"{name} is a {type(arg).__name__}; expected a torch.Tensor {dims}")
    if not (
        isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    ):
        raise AssertionError("checked above")  # narrows the types for the checks below
    named = {"q": q, "k": k, "v": v}
    for name, t in named.items():
        if t.dim() != 4:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} ({t.dim()} dims); expected 4 dims {dims} "
                f"for layout={layout!r}"
            )
        if t.dtype not in _SPARSE_DTYPES:
            allowed = ", ".join(_dtype_name(d) for d in _SPARSE_DTYPES)
            raise ValueError(
                f"{name} has dtype {_dtype_name(t.dtype)}; expected a floating dtype ({allowed})"
            )
    for name in ("k", "v"):
        t = named[name]
        if t.dtype != q.dtype:
            raise ValueError(
                f"{name} has dtype {_dtype_name(t.dtype)} but q has {_dtype_name(q.dtype)}; "
                "expected one dtype for q, k and v"
            )
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; expected one device")
    seq_dim, head_dim = (2, 1) if layout == "BNSD" else (1, 2)
    checks = [("k", "q", 0, "batch"), ("k", "q", head_dim, "heads")]
    checks += [("v", "q", 0, "batch"), ("v", "q", head_dim, "heads")]
    checks += [("k", "q", seq_dim, "tokens")] if same_tokens else []
    checks += [("v", "q" if same_tokens else "k", seq_dim, "tokens")]
    for name, other, dim, what in checks:
        t, ref = named[name], named[other]
        if t.shape[dim] != ref.shape[dim]:
            why = " (self-attention over the same tokens)" if same_tokens else ""
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} ({what} {t.shape[dim]}) but {other} has shape "
                f"{tuple(ref.shape)} ({what} {ref.shape[dim]}); expected equal {what} in "
                f"layout {layout}{why}"
            )
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"k has shape {tuple(k.shape)} (head dim {k.shape[-1]}) but q has shape "
            f"{tuple(q.shape)} (head dim {q.shape[-1]}); expected equal head dims"
        )


def check_latent_shape(
    latent_shape: object, text_len: object, tokens: int, q_shape: tuple[int, ...]
) -> tuple[int, int, int]:
    """The (frames, height, width) grid as ints, after checking it explains ``tokens``.

    Raises:
        ValueError: not three positive ints, a negative ``text_len``, or
            ``frames * height * width + text_len != tokens``.
    """
    if not (
        isinstance(latent_shape, (tuple, list))  # a tuple, not a union: see block_shape
        and len(latent_shape) == 3
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in latent_shape)
    ):
        raise ValueError(
            f"latent_shape={latent_shape!r}; expected three positive ints (frames, height, width)"
        )
    if not isinstance(text_len, int) or isinstance(text_len, bool) or text_len < 0:
        raise ValueError(f"text_len={text_len!r}; expected an int >= 0 (text tokens after video)")
    frames, height, width = latent_shape
    expected = frames * height * width + text_len
    if tokens != expected:
        raise ValueError(
            f"latent_shape={tuple(latent_shape)} with text_len={text_len} means "
            f"{frames}*{height}*{width} + {text_len} = {expected} tokens, but q has shape "
            f"{tuple(q_shape)} ({tokens} tokens)"
        )
    return frames, height, width
