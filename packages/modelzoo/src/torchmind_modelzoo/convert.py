"""``modelzoo convert``: turn a card's model into a deployable artefact plus a JSON manifest.

``export`` cards produce a ``torch.export`` program (``model.pt2``) with the card's dynamic-shape
spec, checked against eager on the example inputs before it is written; ``safetensors`` cards
write weights and config. Arguments and the output folder are checked before the model is built
(:mod:`torchmind_modelzoo.checks`). Every file is written under a temporary name and renamed,
the manifest last, so a crash never leaves an artefact that looks complete, and a failed
``--overwrite`` leaves the previous conversion as it was.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from npu_core.files import atomic_path, sha256_file
from torchmind_modelzoo.build import build_model, resolve_dtype
from torchmind_modelzoo.checks import (
    ARTEFACTS,
    InputError,
    check_out_dir,
    check_source,
    output_folder,
)
from torchmind_modelzoo.examples.base import ExportWrapper, example_for, model_config
from torchmind_modelzoo.schema import ModelCard


def _atomic_target(path: Path, write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp)`` on a temporary file next to ``path``, then rename it into place."""
    with atomic_path(path) as tmp:
        write(tmp)
    return path


def dynamic_shapes(card: ModelCard, inputs: dict[str, torch.Tensor]) -> dict[str, Any] | None:
    """The card's dynamic-shape spec as ``torch.export`` wants it (one Dim object per name).

    Raises:
        ValueError: naming the input or dimension when the spec does not match the inputs.
    """
    if card.convert is None or not card.convert.dynamic:
        return None
    spec, dim_max = card.convert.dynamic, card.convert.dim_max
    dims: dict[str, torch.export.Dim] = {}
    shapes: dict[str, Any] = {}
    for name, tensor in inputs.items():
        entry = spec.get(name, {})
        for index in entry:
            if index >= tensor.dim():
                raise ValueError(
                    f"{card.id}: convert.dynamic.{name} names dim {index}, "
                    f"but the input has {tensor.dim()} dims"
                )
        shapes[name] = {
            i: dims.setdefault(n, torch.export.Dim(n, min=2, max=dim_max)) for i, n in entry.items()
        } or None
    unknown = set(spec) - set(inputs)
    if unknown:
        raise ValueError(
            f"{card.id}: convert.dynamic names unknown inputs {sorted(unknown)}; "
            f"inputs are {sorted(inputs)}"
        )
    return {"inputs": shapes}


def shrink_dynamic(
    inputs: dict[str, torch.Tensor], spec: dict[str, dict[int, str]]
) -> dict[str, torch.Tensor]:
    """Inputs with every dynamic dimension cut to ``max(2, size - 2)`` (a second valid shape)."""
    out = dict(inputs)
    for name, dims in spec.items():
        tensor = out[name]
        for index in dims:
            tensor = tensor.narrow(index, 0, max(2, tensor.shape[index] - 2))
        out[name] = tensor.contiguous()
    return out


def _check_close(reference: torch.Tensor, got: torch.Tensor, what: str) -> float:
    diff = float((reference.float() - got.float()).abs().max()) if reference.numel() else 0.0
    scale = float(reference.float().abs().max()) if reference.numel() else 0.0
    tol = 1e-3 * max(1.0, scale) if reference.dtype == torch.float32 else 5e-2 * max(1.0, scale)
    if reference.shape != got.shape or not diff <= tol:
        raise RuntimeError(
            f"{what}: exported program disagrees with eager "
            f"(shape {tuple(got.shape)} vs {tuple(reference.shape)}, max diff {diff:.3g})"
        )
    return diff


def convert(
    card: ModelCard,
    out: str | os.PathLike[str],
    *,
    tiny: bool,
    path: str | os.PathLike[str] | None = None,
    dtype: str | None = None,
    trust_remote_code: bool = False,
    overwrite: bool = False,
    mfusion: bool = False,
) -> dict[str, Any]:
    """Build the model and write its artefact and ``manifest.json`` into ``out``.

    Args:
        card: a full card.
        out: output directory: absent or empty (created), or holding a previous conversion
            when ``overwrite`` is set.
        tiny: random-weight tiny model from the card's overrides (offline) instead of ``path``.
        path: local model directory when ``tiny`` is False (not both).
        dtype: override of ``card.convert.dtype`` (tiny builds default to float32).
        trust_remote_code: forwarded to transformers only when asked for.
        overwrite: replace a previous conversion in ``out`` (its files are replaced only once
            the new ones are complete; files of the old one that the new one lacks are removed).
        mfusion: also compile the exported program with Inductor and the card's mfusion options
            (:mod:`torchmind_modelzoo.fusion`), check it against eager and record what mfusion did.

    Returns:
        The manifest (also written as ``out/manifest.json``).

    Raises:
        InputError: before any work, for a listed card, a bad dtype, a wrong weight source or
            an output folder that is a file, not empty, holds a conversion (without
            ``overwrite``) or cannot be written.
    """
    if card.convert is None:
        raise InputError(f"{card.id} is a listed card: it has no conversion config")
    dtype_name = dtype or ("float32" if tiny else card.convert.dtype)
    torch_dtype = resolve_dtype(dtype_name)
    check_source(card, tiny=tiny, path=path)
    out = check_out_dir(out, overwrite=overwrite)
    fusion = _mfusion_for(card) if mfusion else None
    with output_folder(out):
        return _convert(card, out, tiny, path, dtype_name, torch_dtype, trust_remote_code, fusion)


def _retire_manifest(out: Path) -> None:
    """Remove a replaced conversion's manifest before the first new file lands.

    Everything that can fail (build, export, the checks against eager) has run by then, so a
    refused conversion leaves the old one whole; and while files are being replaced the folder
    never pairs a new artefact with the old manifest: no manifest means not complete.
    """
    (out / "manifest.json").unlink(missing_ok=True)


def _mfusion_for(card: ModelCard) -> Any:
    from torchmind_modelzoo.fusion import MFusionApplied

    return MFusionApplied(card)


def _convert(
    card: ModelCard,
    out: Path,
    tiny: bool,
    path: str | os.PathLike[str] | None,
    dtype_name: str,
    torch_dtype: torch.dtype,
    trust_remote_code: bool,
    fusion: Any,
) -> dict[str, Any]:
    assert card.convert is not None
    start = time.perf_counter()
    model = build_model(
        card, tiny=tiny, path=path, dtype=torch_dtype, trust_remote_code=trust_remote_code
    )
    from torchmind_modelzoo.fusion import mfusion_options

    manifest: dict[str, Any] = {
        "card": card.id,
        "hub_id": card.hub_id,
        "architecture": card.architecture,
        "tiny": tiny,
        "method": card.convert.method,
        "dtype": dtype_name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "torch": torch.__version__,
        "mfusion": {"applied": False, "options": mfusion_options(card)},
        "liteboost": card.convert.liteboost,
    }
    produced: list[str] = []
    if card.convert.method == "export":
        example = example_for(card)
        inputs = example.inputs(model)
        wrapper = ExportWrapper(example, model).eval()
        shapes = dynamic_shapes(card, inputs)
        with torch.no_grad():
            program = torch.export.export(wrapper, (), inputs, dynamic_shapes=shapes)
            # Guards are still checked by the module's input hook; the generated guard function
            # of torch 2.14 fails with NameError on some symbolic-shape guards.
            exported = program.module(check_guards=False)
            reference = wrapper(**inputs)
            max_diff = _check_close(reference, exported(**inputs), card.id)
            if card.convert.dynamic:
                # A dynamic spec is only real if another shape runs: shrink every dynamic dim.
                other = shrink_dynamic(inputs, card.convert.dynamic)
                max_diff = max(
                    max_diff,
                    _check_close(wrapper(**other), exported(**other), f"{card.id} (resized)"),
                )
            if fusion is not None:
                compiled = fusion.compile(program.module(check_guards=False))
                fused_diff = _check_close(reference, compiled(**inputs), f"{card.id} (mfusion)")
                manifest["mfusion"] = fusion.summary() | {"max_abs_diff_vs_eager": fused_diff}
        _retire_manifest(out)
        artefact = _atomic_target(out / "model.pt2", lambda p: torch.export.save(program, p))
        manifest["inputs"] = {
            k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in inputs.items()
        }
        manifest["dynamic"] = {
            k: {str(i): n for i, n in v.items()} for k, v in card.convert.dynamic.items()
        }
        manifest["output_shape"] = list(reference.shape)
        manifest["max_abs_diff_vs_eager"] = max_diff
    else:
        from safetensors import safe_open
        from safetensors.torch import save_file

        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        # Tied weights share storage; safetensors refuses aliases, so keep one copy of each.
        seen: dict[int, str] = {}
        for key in list(state):
            ptr = state[key].data_ptr()
            if ptr in seen:
                del state[key]
            else:
                seen[ptr] = key
        _retire_manifest(out)
        artefact = _atomic_target(out / "model.safetensors", lambda p: save_file(state, str(p)))
        with safe_open(str(artefact), framework="pt") as f:
            # The header must list every tensor with its shape: a cheap check of what was written.
            written = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
        if written != {k: tuple(v.shape) for k, v in state.items()}:
            raise RuntimeError(f"{card.id}: {artefact} does not hold the model's tensors")
        library_config = model_config(model)
        config = (
            library_config.to_dict() if hasattr(library_config, "to_dict") else dict(library_config)
        )
        _atomic_target(
            out / "config.json", lambda p: p.write_text(json.dumps(config, indent=2, default=str))
        )
        produced.append("config.json")
        manifest["tensors"] = len(state)
        if fusion is not None:
            manifest["mfusion"] = {
                "applied": False,
                "options": fusion.options,
                "reason": "safetensors cards are not exported, so there is no program to compile",
            }
    manifest["artefact"] = artefact.name
    manifest["sha256"] = sha256_file(artefact)
    manifest["bytes"] = artefact.stat().st_size
    manifest["seconds"] = round(time.perf_counter() - start, 3)
    produced += [artefact.name, "manifest.json"]
    for stale in set(ARTEFACTS) - set(produced):  # left by a replaced conversion of another kind
        (out / stale).unlink(missing_ok=True)
    _atomic_target(
        out / "manifest.json",
        lambda p: p.write_text(json.dumps(manifest, indent=2, default=str) + "\n"),
    )
    return manifest
