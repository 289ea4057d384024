"""Checks of ``liteboost generate``'s inputs that run before any model is built or rank starts.

Every input that can be judged from the options, the model folder's config files and this
process's installed packages is judged here, so that a bad one costs a second and one line
instead of a model load, a whole render and a traceback from every rank. Each failure is a
:class:`PreflightError` whose message names the option, the value and what is allowed. What can
only be known inside the ranks (a model's weights, a torchrun world size) stays with them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from liteboost import env
from liteboost.attention.backends import ATTENTION_BACKENDS, AttentionCall, forced_backend
from liteboost.forced_kernels import check_forced
from liteboost.tiny import TINY_TRANSFORMER, TINY_VAE
from npu_core import env as npu_env
from npu_core.device import check_comm_backend, comm_backend
from npu_core.files import UnwritableFolderError, check_writable_folder

# WanPipeline.check_inputs refuses heights and widths that are not multiples of 16.
_PIPELINE_MULTIPLE = 16


class PreflightError(ValueError):
    """A ``liteboost generate`` input that cannot work; the message is one line."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"Invalid value for '{option}': {message}")
        self.option = option


@dataclass(frozen=True)
class ModelFacts:
    """What the checks need from a model's configs, read without loading any weights.

    Attributes:
        patch_size: the transformer's (frames, height, width) patch.
        head_dim: the transformer's attention head dim.
        scale_spatial: the VAE's pixel-to-latent factor along height and width.
        scale_temporal: the VAE's frame-to-latent factor (Wan wants ``frames = k * t + 1``).
        dtype: the dtype the pipeline loads in (``from_pretrained`` default: fp32).
        device: the device ``liteboost generate`` runs the pipeline on.
    """

    patch_size: tuple[int, int, int]
    head_dim: int
    scale_spatial: int
    scale_temporal: int
    dtype: torch.dtype = torch.float32
    device: str = "cpu"

    @property
    def pixel_multiple(self) -> int:
        """Height and width must be multiples of this: the pipeline's 16 and whole patches."""
        return math.lcm(_PIPELINE_MULTIPLE, self.scale_spatial * self.patch_size[1])


def _vae_scales(vae: dict) -> tuple[int, int]:
    # AutoencoderKLWan records its factors (diffusers >= 0.35); older configs imply them from
    # the number of (temporal) downsampling stages, as the pipeline did.
    downsample = vae.get("temperal_downsample", [False, True, True])
    spatial = vae.get("scale_factor_spatial", 2 ** len(downsample))
    temporal = vae.get("scale_factor_temporal", 2 ** sum(bool(x) for x in downsample))
    return int(spatial), int(temporal)


def tiny_model_facts() -> ModelFacts:
    """Facts of the built-in tiny random-weight Wan."""
    spatial, temporal = _vae_scales(TINY_VAE)
    frames, height, width = TINY_TRANSFORMER["patch_size"]
    return ModelFacts(
        patch_size=(frames, height, width),
        head_dim=int(TINY_TRANSFORMER["attention_head_dim"]),
        scale_spatial=spatial,
        scale_temporal=temporal,
    )


def _read_json(path: Path, option: str, folder: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PreflightError(
            option,
            f"{folder} has no {path.relative_to(folder)}; expected a diffusers WanPipeline folder "
            "(as written by save_pretrained)",
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PreflightError(option, f"{path} is not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise PreflightError(option, f"{path} holds a JSON {type(data).__name__}, not an object")
    return data


def model_facts(model: str | None) -> ModelFacts:
    """Facts of ``--model`` (a diffusers Wan folder) from its JSON configs, or of the tiny Wan.

    Raises:
        PreflightError: the folder is missing, is not a WanPipeline folder, or a config lacks a
            field the pipeline needs.
    """
    if model is None:
        return tiny_model_facts()
    folder = Path(model)
    if not folder.is_dir():
        what = "a file" if folder.exists() else "no such folder"
        raise PreflightError(
            "--model", f"{model} is {what}; expected a diffusers Wan folder on disk"
        )
    index = _read_json(folder / "model_index.json", "--model", folder)
    if index.get("_class_name") != "WanPipeline":
        raise PreflightError(
            "--model",
            f"{folder} holds a {index.get('_class_name')!r}; liteboost generate runs WanPipeline "
            "(text-to-video) folders",
        )
    transformer = _read_json(folder / "transformer" / "config.json", "--model", folder)
    vae = _read_json(folder / "vae" / "config.json", "--model", folder)
    try:
        patch = [int(x) for x in transformer["patch_size"]]
        head_dim = int(transformer["attention_head_dim"])
    except (KeyError, TypeError, ValueError) as exc:
        raise PreflightError(
            "--model", f"{folder}/transformer/config.json lacks a usable {exc}"
        ) from None
    if len(patch) != 3:
        raise PreflightError(
            "--model",
            f"{folder}/transformer/config.json has patch_size {patch}; expected three "
            "(frames, height, width) sizes",
        )
    frames, height, width = patch
    spatial, temporal = _vae_scales(vae)
    return ModelFacts((frames, height, width), head_dim, spatial, temporal)


def check_size(height: int, width: int, frames: int, facts: ModelFacts) -> None:
    """Height and width whole multiples of the latent patch grid, frames ``k * t + 1``.

    The pipeline refuses other sizes only after the model is loaded (height, width) or rounds
    the frame count silently with a log warning (frames); both are refused here instead.
    """
    multiple = facts.pixel_multiple
    for option, value in (("--height", height), ("--width", width)):
        if value < multiple or value % multiple:
            lower = max(multiple, value // multiple * multiple)
            raise PreflightError(
                option,
                f"{value} is not a multiple of {multiple} (VAE {facts.scale_spatial}x spatial "
                f"compression x patch {facts.patch_size[1]}, pipeline needs 16); use {lower} or "
                f"{lower + multiple}",
            )
    t = facts.scale_temporal
    if frames < 1 or (frames - 1) % t:
        lower = max(1, (frames - 1) // t * t + 1)
        raise PreflightError(
            "--frames",
            f"{frames} is not {t}k + 1 (the VAE compresses {t} frames into one latent frame "
            f"after the first); use {lower} or {lower + t}",
        )


def check_attention_backend(name: str | None, facts: ModelFacts) -> None:
    """A forced dense backend (option or ``LITEBOOST_ATTENTION_BACKEND``) that can run here.

    The rule ``BoostManager`` applies (:func:`liteboost.forced_kernels.check_forced`) on the
    call generate will make (device, dtype, head dim), so ``fa3`` on a CPU run is refused now
    rather than at the first attention call.
    """
    option = "--attention-backend" if name is not None else "LITEBOOST_ATTENTION_BACKEND"
    source = "attention_backend" if name is not None else env.ATTENTION_BACKEND
    try:
        forced = forced_backend(name)
        if forced is None:
            return
        call = AttentionCall.on(facts.device, facts.dtype, facts.head_dim)
        check_forced(ATTENTION_BACKENDS, forced.value, [call], source)
    except ValueError as exc:
        raise PreflightError(option, f"{exc} (generate runs on {facts.device})") from None


def output_paths(out: Path, video_format: str) -> list[Path]:
    """The files ``liteboost generate`` writes into ``out``."""
    return [out / f"video.{video_format}", out / "contact_sheet.png"]


def check_out(out: Path, video_format: str, overwrite: bool) -> None:
    """``--out`` is a folder (or can become one) this process can write into, and each output
    path in it can become a file.

    Outputs of an earlier run are refused unless ``overwrite``: they are then replaced
    atomically when the new ones are complete. A folder (or anything else that is not a file)
    where an output goes is refused even with ``overwrite``: the run could not replace it and
    would fail after rendering the whole video. Nothing is created or left behind
    (:func:`npu_core.files.check_writable_folder`).
    """
    try:
        check_writable_folder(out)
    except UnwritableFolderError as exc:
        raise PreflightError("--out", str(exc)) from None
    earlier = []
    for path in output_paths(out, video_format):
        if path.is_dir():
            raise PreflightError(
                "--out",
                f"{path} is a folder, where liteboost generate writes its {path.name} file; "
                "move it away or choose another folder",
            )
        if path.exists() and not path.is_file():
            raise PreflightError(
                "--out",
                f"{path} exists and is not a regular file, where liteboost generate writes its "
                f"{path.name}; move it away or choose another folder",
            )
        if path.is_symlink() or path.exists():
            earlier.append(path.name)
    if earlier and not overwrite:
        raise PreflightError(
            "--out",
            f"{out} already holds {' and '.join(earlier)} from an earlier run; pass --overwrite "
            "to replace them or choose another folder",
        )


def check_comm_backend_here() -> None:
    """The collective backend every rank will start (``NPU_CORE_COMM_BACKEND`` or the one
    detected) can run in this process: otherwise each rank would fail at start-up."""
    try:
        name = comm_backend().value
    except RuntimeError as exc:  # NPU_CORE_BACKEND names a device this machine lacks
        raise PreflightError(npu_env.BACKEND, str(exc)) from None
    except ValueError as exc:  # NPU_CORE_COMM_BACKEND names no backend
        raise PreflightError(npu_env.COMM_BACKEND, str(exc)) from None
    try:
        check_comm_backend(name)
    except ValueError as exc:
        raise PreflightError(npu_env.COMM_BACKEND, str(exc)) from None


def check_numbers(*, nproc: int, timeout: float) -> None:
    """The launcher's options (the numeric options of the run are ranges of
    :class:`liteboost.generate.GenerateOptions` fields, checked when the options are built)."""
    if nproc < 1:
        raise PreflightError("--nproc", f"{nproc}; expected an integer >= 1")
    if not (timeout > 0 and math.isfinite(timeout)):
        raise PreflightError("--timeout", f"{timeout}; expected a finite number of seconds > 0")


def check_mesh(*, nproc: int | None, cfg: int, ulysses: int | None, ring: int) -> None:
    """The CFG x Ring x Ulysses degrees against the rank count, by ParallelManager's own rule.

    ``nproc`` is None under torchrun, where the world size is known only inside the ranks (the
    manager checks there).
    """
    from liteboost.parallel.config import resolve_degrees

    if nproc is None:
        return
    try:
        resolve_degrees(nproc, cfg, ulysses, ring)
    except ValueError as exc:
        option = "--ulysses" if ulysses is not None else "--cfg-parallel/--ring"
        raise PreflightError(option, f"{exc} (--nproc {nproc})") from None
