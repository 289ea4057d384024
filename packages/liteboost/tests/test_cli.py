"""``liteboost generate`` end to end: 2 ranks, sparse + Ulysses + VAE parallel, files on disk;
``liteboost build-cpu-kernel``: the extension built or loaded, where it is, why it is not."""

import os
import subprocess
import sys

import pytest
from PIL import Image
from typer.testing import CliRunner

from liteboost.cli import app


def test_help_lists_the_options():
    result = CliRunner().invoke(app, ["generate", "--help"])
    assert result.exit_code == 0
    for option in ("--nproc", "--sparsity", "--ulysses", "--vae-parallel", "--model", "--format"):
        assert option in result.output


def test_missing_model_folder_is_a_clear_error(tmp_path):
    result = CliRunner().invoke(app, ["generate", "--model", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert "Invalid value for '--model'" in result.output


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(1000)  # catches hangs only: one shared core or a loaded machine is slow
def test_generate_two_ranks_writes_gif_and_contact_sheet(tmp_path):
    out = tmp_path / "run"
    args = ["generate", "--nproc", "2", "--steps", "2", "--frames", "5", "--sparsity", "0.5"]
    args += ["--block-size", "16", "--out", str(out), "--timeout", "900"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    gif = Image.open(out / "video.gif")
    assert gif.n_frames == 5 and gif.size == (64, 64)
    sheet = Image.open(out / "contact_sheet.png")
    assert sheet.size == (3 * 64, 2 * 64)
    assert sorted(p.name for p in out.iterdir()) == ["contact_sheet.png", "video.gif"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(1000)
def test_generate_with_step_cache_and_spatial_vae(tmp_path):
    """The cache and VAE-mode options reach BoostManager / ParallelManager and a video comes out."""
    out = tmp_path / "run"
    args = ["generate", "--nproc", "2", "--steps", "3", "--frames", "5", "--out", str(out)]
    args += ["--cache", "first_block", "--cache-threshold", "0.2", "--vae-mode", "spatial"]
    result = CliRunner().invoke(app, [*args, "--timeout", "900"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert Image.open(out / "video.gif").n_frames == 5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cache", "pab", "--cache-threshold", "0.2"], "cache_threshold applies to"),
        (["--cache", "magic"], "Input should be 'first_block', 'pab', 'taylorseer' or 'faster'"),
        (["--vae-mode", "diagonal"], "vae_mode: Input should be 'temporal' or 'spatial'"),
    ],
)
def test_cache_and_vae_mode_refused_before_work(tmp_path, args, message):
    result = CliRunner().invoke(app, ["generate", *args, "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert message in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_help_lists_the_build_command():
    top = CliRunner().invoke(app, ["--help"])
    assert top.exit_code == 0 and "build-cpu-kernel" in top.output
    result = CliRunner().invoke(app, ["build-cpu-kernel", "--help"])
    assert result.exit_code == 0
    for phrase in ("block-sparse", "RoPE", "TORCH_EXTENSIONS_DIR", "Exit 1"):
        assert phrase in result.output


@pytest.mark.timeout(900)  # builds the extension when no earlier test of the session did
def test_build_cpu_kernel_names_the_library_the_kernels_load(cpu_kernel):
    """After the kernels' own first load (a build on a fresh machine), the command loads the
    same build from the cache and prints its name and file."""
    module = cpu_kernel
    result = CliRunner().invoke(app, ["build-cpu-kernel"])
    assert result.exit_code == 0, result.output
    assert f"already built; loaded {module.__name__} (" in result.output
    assert f"cached at {module.__file__}" in result.output


@pytest.mark.timeout(600)
def test_build_cpu_kernel_without_a_compiler_logs_the_build_and_exits_1(tmp_path):
    """A real failed build, in a fresh cache folder with a compiler that does not exist (in a
    subprocess: torch's in-process build registry would remember the other folder): the INFO
    line announcing the build names that folder, the error the compiler's failure; exit 1."""
    script = (
        "import logging, sys; logging.basicConfig(level=logging.INFO); "
        "from liteboost.cli import main; sys.argv = ['liteboost', 'build-cpu-kernel']; main()"
    )
    environment = os.environ | {
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "cache"),
        "CXX": str(tmp_path / "no-compiler"),
    }
    done = subprocess.run(
        [sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=500
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "building liteboost's CPU kernel extension" in done.stderr
    assert str(tmp_path / "cache" / "liteboost") in done.stderr
    assert "error: the CPU kernel extension cannot be built here" in done.stderr
    assert "no-compiler" in done.stderr
