"""Bad inputs are refused before any work: exit 2, one line naming the input, nothing written.

``liteboost generate`` is driven through its typer app with the launcher replaced by a spy, so
each case also proves that no rank was started (and no model built). ``sparse_attention`` is
checked at sparsity 0 (the dense route) and 0.5 (the sparse route): the same input must be
refused the same way on both.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from pathlib import Path

import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from typer.testing import CliRunner

import liteboost.forced_kernels
import npu_core.dist
from liteboost import BoostManager
from liteboost.attention.processor import BoostedWanAttnProcessor
from liteboost.cli import app, main
from liteboost.ops import sparse_attention
from liteboost.tiny import build_tiny_transformer
from npu_core.device import Backend
from npu_core.dist import launch


@pytest.fixture
def launches(monkeypatch) -> list[tuple]:
    """Replaces the launcher: records each call instead of starting ranks."""
    calls: list[tuple] = []

    def fake_run(fn, nproc, *args, **kwargs):
        calls.append((fn, nproc, args))
        return [None]

    monkeypatch.setattr(npu_core.dist, "run", fake_run)
    monkeypatch.delenv("LITEBOOST_ATTENTION_BACKEND", raising=False)
    return calls


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"<dir>"
        for p in sorted(root.rglob("*"))
    }


def _wan_folder(root: Path, *, cls="WanPipeline", vae: dict | None = None) -> Path:
    """A model folder holding only the JSON configs preflight reads (no weights)."""
    root.mkdir(parents=True)
    (root / "model_index.json").write_text(json.dumps({"_class_name": cls}))
    (root / "transformer").mkdir()
    (root / "transformer" / "config.json").write_text(
        json.dumps({"patch_size": [1, 2, 2], "attention_head_dim": 128})
    )
    (root / "vae").mkdir()
    (root / "vae" / "config.json").write_text(json.dumps(vae or {}))
    return root


def _refused(launches, tmp_path, args, match, *, env=None):
    """Run ``generate`` with ``args``; assert exit 2, one stderr line matching, nothing done."""
    before = _tree(tmp_path)
    result = CliRunner().invoke(app, ["generate", *args], env=env)
    assert result.exit_code == 2, result.output + repr(result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    assert match in lines[0], lines[0]
    assert launches == [], "no rank may start for a refused input"
    assert _tree(tmp_path) == before, "a refused run must write nothing"
    return lines[0]


BAD_OPTIONS = [
    (["--height", "60"], "'--height': 60 is not a multiple of 16"),
    (["--width", "72"], "'--width': 72 is not a multiple of 16"),
    (["--height", "8"], "height: Input should be greater than or equal to 16"),
    (["--frames", "8"], "'--frames': 8 is not 4k + 1"),
    (["--attention-backend", "bogus"], "attention_backend='bogus' is not a backend"),
    (["--timeout", "-1"], "'--timeout': -1.0"),
    (["--timeout", "inf"], "'--timeout': inf"),
    (["--ulysses", "3", "--nproc", "2"], "ulysses_degree=3 x ring_degree=1 = 3"),
    (["--cfg-parallel", "2", "--nproc", "3"], "'--cfg-parallel/--ring': cfg_degree=2"),
    (["--cfg-parallel", "3"], "cfg_parallel: Input should be less than or equal to 2"),
    (["--ulysses", "0"], "ulysses: Input should be greater than or equal to 1"),
    (["--nproc", "0"], "'--nproc': 0"),
    (["--sparsity", "1.0"], "sparsity: Input should be less than 1"),
    (["--sparsity", "-0.1"], "sparsity: Input should be greater than or equal to 0"),
    (["--guidance", "nan"], "guidance: Input should be a finite number"),
    (["--steps", "0"], "steps: Input should be greater than or equal to 1"),
    (["--block-size", "0"], "block_size: Input should be greater than or equal to 1"),
    (["--max-sequence-length", "0"], "max_sequence_length: Input should be greater than"),
    (["--format", "webm"], "video_format: Input should be 'gif' or 'mp4'"),
    (["--set", "bogus=1"], "bogus: Extra inputs are not permitted"),
    (["--set", "steps=true"], "steps: a boolean is not a number"),
]


@pytest.mark.parametrize(("args", "match"), BAD_OPTIONS, ids=lambda x: " ".join(x)[:40])
def test_bad_option_is_refused_before_any_rank(launches, tmp_path, args, match):
    _refused(launches, tmp_path, [*args, "--out", str(tmp_path / "out")], match)


UNPARSABLE = [
    (["--height", "abc"], "Invalid value for '--height': 'abc': Input should be a valid integer"),
    (["--guidance", "x"], "Invalid value for '--guidance': 'x': Input should be a valid number"),
    (["--heigth", "64"], "No such option: --heigth"),
]


@pytest.mark.parametrize(("args", "match"), UNPARSABLE, ids=lambda x: " ".join(x)[:40])
def test_values_click_cannot_parse_are_one_line_from_the_console_script(
    launches, tmp_path, monkeypatch, capsys, args, match
):
    # main(), the `liteboost` script, not the typer app: typer alone prints a multi-line box
    argv = ["liteboost", "generate", *args, "--out", str(tmp_path / "out")]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exited:
        main()
    out, err = capsys.readouterr()
    assert exited.value.code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and match in err, err
    assert launches == [] and not (tmp_path / "out").exists()


def test_fa3_on_this_cpu_run_is_refused_by_its_declared_constraints(launches, tmp_path):
    """fa3 is either not importable here or refuses device 'cpu': both before rendering."""
    line = _refused(
        launches, tmp_path, ["--attention-backend", "fa3", "--out", str(tmp_path / "o")], "'fa3'"
    )
    assert "generate runs on cpu" in line


def test_bad_backend_in_the_environment_is_refused(launches, tmp_path):
    _refused(
        launches,
        tmp_path,
        ["--out", str(tmp_path / "o")],
        "LITEBOOST_ATTENTION_BACKEND='bogus'",
        env={"LITEBOOST_ATTENTION_BACKEND": "bogus"},
    )


def test_unknown_collective_backend_is_refused_before_any_rank(launches, tmp_path):
    out = ["--out", str(tmp_path / "o")]
    env = {"NPU_CORE_COMM_BACKEND": "bogus"}
    _refused(launches, tmp_path, out, "'NPU_CORE_COMM_BACKEND': ", env=env)


@pytest.mark.skipif(torch.cuda.is_available(), reason="nccl can run where CUDA is")
def test_nccl_without_cuda_is_refused_before_any_rank(launches, tmp_path):
    """Every rank would fail to start its process group; refused once, before any starts."""
    out = ["--out", str(tmp_path / "o"), "--nproc", "2"]
    env = {"NPU_CORE_COMM_BACKEND": "nccl"}
    line = _refused(launches, tmp_path, out, "collective backend 'nccl' cannot run here", env=env)
    assert "usable here: gloo" in line


def test_config_file_missing_or_with_unknown_key(launches, tmp_path):
    _refused(launches, tmp_path, ["--config", str(tmp_path / "none.toml")], "no such file")
    bad = tmp_path / "bad.toml"
    bad.write_text("stepz = 3\n")
    _refused(launches, tmp_path, ["--config", str(bad)], "stepz: Extra inputs")


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc (Linux)")
def test_unwritable_out_is_refused(launches, tmp_path):
    """/proc refuses new files even to root (a chmod'ed folder would not stop root)."""
    _refused(launches, tmp_path, ["--out", "/proc/liteboost-x"], "is not writable")


def test_out_that_is_a_file_or_under_a_file(launches, tmp_path):
    file = tmp_path / "file"
    file.write_text("keep me")
    _refused(launches, tmp_path, ["--out", str(file)], "is a file; expected a folder")
    _refused(launches, tmp_path, ["--out", str(file / "sub")], "cannot be created")


@pytest.mark.parametrize("video_format", ["gif", "mp4"])
def test_earlier_outputs_are_kept_unless_overwrite(launches, tmp_path, video_format):
    out = tmp_path / "run"
    out.mkdir()
    (out / f"video.{video_format}").write_bytes(b"earlier video")
    args = ["--out", str(out), "--format", video_format]
    _refused(launches, tmp_path, args, "pass --overwrite")
    result = CliRunner().invoke(app, ["generate", *args, "--overwrite"])
    assert result.exit_code == 0, result.output
    assert len(launches) == 1, "--overwrite lets the run start"
    assert (out / f"video.{video_format}").read_bytes() == b"earlier video", (
        "replaced only at the end"
    )


@pytest.mark.parametrize("name", ["video.gif", "contact_sheet.png"])
@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]], ids=["", "--overwrite"])
def test_an_output_path_that_is_a_folder_is_refused_before_any_rank(
    launches, tmp_path, name, overwrite
):
    """The video and the sheet are written after the whole render: a folder in their place
    (which no rename can replace) is refused first, with --overwrite too."""
    out = tmp_path / "out"
    (out / name).mkdir(parents=True)
    (out / name / "keep.txt").write_text("the user's")
    _refused(launches, tmp_path, ["--out", str(out), *overwrite], f"{out / name} is a folder")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes (POSIX)")
def test_an_output_path_that_is_not_a_regular_file_is_refused(launches, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "contact_sheet.png")
    args = ["--out", str(out), "--overwrite"]
    _refused(launches, tmp_path, args, "contact_sheet.png exists and is not a regular file")


def test_model_folder_faults(launches, tmp_path):
    _refused(launches, tmp_path, ["--model", str(tmp_path / "nope")], "no such folder")
    blob = tmp_path / "weights.bin"
    blob.write_bytes(bytes(range(256)))
    _refused(launches, tmp_path, ["--model", str(blob)], "is a file")
    empty = tmp_path / "empty"
    empty.mkdir()
    _refused(launches, tmp_path, ["--model", str(empty)], "has no model_index.json")
    binary = tmp_path / "binary"
    binary.mkdir()
    (binary / "model_index.json").write_bytes(b"\x00\xff\xfe" * 10)
    _refused(launches, tmp_path, ["--model", str(binary)], "is not readable JSON")
    i2v = _wan_folder(tmp_path / "i2v", cls="WanImageToVideoPipeline")
    _refused(launches, tmp_path, ["--model", str(i2v)], "'WanImageToVideoPipeline'")
    no_vae = _wan_folder(tmp_path / "novae")
    (no_vae / "vae" / "config.json").unlink()
    _refused(launches, tmp_path, ["--model", str(no_vae)], "has no vae/config.json")


def test_model_configs_decide_the_size_rule(launches, tmp_path):
    """A 16x VAE (Wan2.2 TI2V 5B) with 2x2 patches needs multiples of 32: 48 is refused, 64 runs."""
    model = _wan_folder(tmp_path / "ti2v", vae={"scale_factor_spatial": 16})
    base = ["--model", str(model), "--out", str(tmp_path / "o")]
    _refused(
        launches, tmp_path, [*base, "--height", "48"], "'--height': 48 is not a multiple of 32"
    )
    result = CliRunner().invoke(app, ["generate", *base, "--height", "64", "--width", "96"])
    assert result.exit_code == 0, result.output
    config = launches[0][2][0]
    assert (config.height, config.width, config.model) == (64, 96, str(model))


def test_tiny_size_rule_matches_the_built_models():
    """The rule for the built-in model, against the factors the built VAE reports (WanPipeline
    reads ``vae.config.scale_factor_*``) and the built transformer's patch."""
    from liteboost.preflight import tiny_model_facts
    from liteboost.tiny import build_tiny_transformer, build_tiny_vae

    vae, transformer = build_tiny_vae().config, build_tiny_transformer().config
    facts = tiny_model_facts()
    assert facts.pixel_multiple == max(16, vae.scale_factor_spatial * transformer.patch_size[1])
    assert facts.scale_temporal == vae.scale_factor_temporal
    assert facts.head_dim == transformer.attention_head_dim


# sparse_attention: the same refusal at every sparsity.
Q = (1, 2, 48, 12)  # BNSD, latent grid (3, 4, 4)


def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


SPARSE_FAULTS = {
    "k tokens": (
        lambda: (_t(*Q), _t(1, 2, 40, 12), _t(1, 2, 40, 12)),
        {},
        r"k has shape \(1, 2, 40, 12\) \(tokens 40\)",
    ),
    "latent_shape": (
        lambda: (_t(*Q),) * 3,
        {"latent_shape": (3, 4, 5)},
        r"latent_shape=\(3, 4, 5\).*60 tokens.*48 tokens",
    ),
    "latent_shape rank": (
        lambda: (_t(*Q),) * 3,
        {"latent_shape": (48,)},
        r"latent_shape=\(48,\); expected three positive ints",
    ),
    "text_len": (lambda: (_t(*Q),) * 3, {"text_len": -1}, r"text_len=-1"),
    "3-D q": (
        lambda: (_t(2, 48, 12),) * 3,
        {},
        r"q has shape \(2, 48, 12\) \(3 dims\); expected 4 dims",
    ),
    "k head dim": (
        lambda: (_t(*Q), _t(1, 2, 48, 8), _t(*Q)),
        {},
        r"k has shape \(1, 2, 48, 8\) \(head dim 8\)",
    ),
    "v heads": (
        lambda: (_t(*Q), _t(*Q), _t(1, 3, 48, 12)),
        {},
        r"v has shape \(1, 3, 48, 12\) \(heads 3\)",
    ),
    "int inputs": (
        lambda: (_t(*Q, dtype=torch.int64),) * 3,
        {},
        r"q has dtype int64; expected a floating",
    ),
    "mixed dtypes": (
        lambda: (_t(*Q), _t(*Q).half(), _t(*Q)),
        {},
        r"k has dtype float16 but q has float32",
    ),
    "scale": (lambda: (_t(*Q),) * 3, {"scale": -1.0}, r"scale=-1.0"),
    "layout": (lambda: (_t(*Q),) * 3, {"layout": "SBND"}, r"layout='SBND'"),
}


@pytest.mark.parametrize("sparsity", [0.0, 0.5])
@pytest.mark.parametrize("case", list(SPARSE_FAULTS))
def test_sparse_attention_refuses_the_same_way_at_every_sparsity(case, sparsity):
    make, kwargs, match = SPARSE_FAULTS[case]
    args = {"latent_shape": (3, 4, 4), "sparsity": sparsity, "block_size": 16, **kwargs}
    with pytest.raises(ValueError, match=match):
        sparse_attention(*make(), **args)


def test_sparse_attention_refuses_non_tensors():
    with pytest.raises(TypeError, match=r"k is a list; expected a torch\.Tensor"):
        sparse_attention(_t(*Q), [0.0], _t(*Q), latent_shape=(3, 4, 4), sparsity=0.0)


def test_hybrid_layout_passes_the_checks_and_reaches_the_ranks(launches, tmp_path):
    """A valid CFG x Ulysses x Ring layout is accepted and shipped to the ranks as options."""
    args = ["--cfg-parallel", "2", "--ulysses", "2", "--ring", "1", "--nproc", "4"]
    result = CliRunner().invoke(app, ["generate", *args, "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    (_, nproc, (config,)) = launches[0]
    assert nproc == 4 and (config.cfg_parallel, config.ulysses, config.ring) == (2, 2, 1)


def test_ring_with_sparsity_is_accepted_and_reaches_the_ranks(launches, tmp_path):
    """Since 0.4.2 the Wan plan runs block-sparse ring attention: a ring with --sparsity passes."""
    args = ["--ring", "2", "--nproc", "2", "--sparsity", "0.5", "--block-size", "16"]
    result = CliRunner().invoke(app, ["generate", *args, "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    (_, nproc, (config,)) = launches[0]
    assert nproc == 2 and (config.ring, config.sparsity) == (2, 0.5)


def test_cache_and_vae_mode_options_reach_the_ranks(launches, tmp_path):
    """--cache (incl. faster), --cache-threshold and --vae-mode are shipped as options."""
    for extra, expected in [
        (["--cache", "faster", "--vae-mode", "temporal"], ("faster", None, "temporal")),
        (["--cache", "first_block", "--cache-threshold", "0.2"], ("first_block", 0.2, None)),
    ]:
        launches.clear()
        out = tmp_path / extra[1]
        result = CliRunner().invoke(app, ["generate", *extra, "--out", str(out)])
        assert result.exit_code == 0, result.output
        (_, _, (config,)) = launches[0]
        assert (config.cache, config.cache_threshold, config.vae_mode) == expected


# BoostManager: a forced kernel that cannot run here is refused when boosting, not at a forward.


@pytest.fixture
def cpu_machine(monkeypatch):
    """This machine described as having no accelerator, whatever it has."""
    monkeypatch.setattr(liteboost.forced_kernels, "detect_backend", lambda: Backend.CPU)
    monkeypatch.delenv("LITEBOOST_ATTENTION_BACKEND", raising=False)


# What can run on CPU, from the documented constraints: every dense backend but SDPA needs an
# accelerator (FlashAttention CUDA, npu_fusion_attention Ascend); the sparse "npu" kernel needs
# an NPU, the fused "cpu", flex, gather and reference kernels run on CPU.
FORCED_ON_CPU = [
    ({"attention_backend": "fa3"}, "attention_backend='fa3'", "(allowed: cuda)", "sdpa"),
    ({"attention_backend": "fa2"}, "attention_backend='fa2'", "(allowed: cuda)", "sdpa"),
    ({"attention_backend": "npu"}, "attention_backend='npu'", "(allowed: npu)", "sdpa"),
    (
        {"sparse_kernel": "npu", "sparsity": 0.5},
        "sparse_kernel='npu'",
        "(allowed: npu)",
        "cpu, flex, gather, reference",
    ),
]


@pytest.mark.parametrize(("kwargs", "named", "why", "usable"), FORCED_ON_CPU)
def test_boost_manager_refuses_a_forced_kernel_that_cannot_run_here(
    cpu_machine, kwargs, named, why, usable
):
    model = build_tiny_transformer()
    with pytest.raises(ValueError, match="cannot run here") as refused:
        BoostManager(model, block_size=16, **kwargs)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"{named} cannot run here: device 'cpu' {why}"), message
    assert message.endswith(f"usable here: {usable}"), message
    processors = model.attn_processors.values()
    assert all(isinstance(p, WanAttnProcessor) for p in processors), "nothing may stay attached"


def test_boost_manager_refuses_a_forced_backend_from_the_environment(cpu_machine, monkeypatch):
    monkeypatch.setenv("LITEBOOST_ATTENTION_BACKEND", "fa3")
    with pytest.raises(ValueError, match=r"^LITEBOOST_ATTENTION_BACKEND='fa3' cannot run here"):
        BoostManager(build_tiny_transformer())


def test_boost_manager_takes_a_forced_kernel_that_runs_here(cpu_machine):
    """Forcing what CPU can run is accepted: the boost is attached."""
    model = build_tiny_transformer()
    with BoostManager(model, attention_backend="sdpa", sparse_kernel="reference", sparsity=0.5):
        processors = model.attn_processors.values()
        assert processors and all(isinstance(p, BoostedWanAttnProcessor) for p in processors)


# Every run ended with resource_tracker's "There appear to be 1 leaked semaphore objects": each
# rank's progress bars (tqdm, through diffusers and the hub) create a multiprocessing lock, a
# named semaphore, and the launcher terminated the ranks before their exit unlinked it.
_RANK_LOCKS: list = []


def _rank_making_a_lock() -> str | None:
    """What tqdm does in each rank: a module-lifetime multiprocessing lock; returns its name."""
    lock = multiprocessing.RLock()
    _RANK_LOCKS.append(lock)
    # CPython's named POSIX semaphore (None when the start method unlinks it at once)
    return lock._semlock.name


@pytest.mark.distributed
@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="named semaphores in /dev/shm (Linux)")
def test_semaphores_a_rank_creates_are_released_when_the_launch_returns():
    names = launch(_rank_making_a_lock, 2, timeout=120)
    assert all(names), "the ranks' locks must be named semaphores for this test to see them"
    left = [name for name in names if Path("/dev/shm", "sem." + name.lstrip("/")).exists()]
    assert left == [], f"semaphores {left} outlived their ranks (leaked to the resource tracker)"


@pytest.mark.distributed
def test_a_failed_rank_is_one_line_naming_it_with_its_traceback_kept(tmp_path):
    """A model folder whose configs pass the checks but that holds no weights: every rank fails
    loading it, and the user reads one line naming the rank and the cause, exit 1."""
    model = _wan_folder(tmp_path / "configs-only")
    out = tmp_path / "out"
    args = ["generate", "--model", str(model), "--nproc", "2", "--out", str(out)]
    result = CliRunner().invoke(app, args, env={"LITEBOOST_ATTENTION_BACKEND": ""})
    assert result.exit_code == 1, result.output + repr(result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("error: rank "), line
    rank = int(line.removeprefix("error: rank ").split(":")[0])
    log = out / "logs" / f"rank{rank}.log"
    assert line.endswith(f"(traceback in {log})"), line
    assert "Traceback" in log.read_text() and "from_pretrained" in log.read_text()
    assert sorted(p.name for p in out.iterdir()) == ["logs"], "no output of a failed run"
