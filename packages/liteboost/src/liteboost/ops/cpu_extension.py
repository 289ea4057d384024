"""liteboost's C++ CPU extension (``csrc/block_sparse_attention.cpp``): build once, load after.

The extension holds the fused block-sparse attention kernel (``fused_cpu``, the CPU default) and
the eager RoPE loop (``rope``). ``torch.utils.cpp_extension`` compiles it on first use, about a
minute on two cores, so a first sparse or RoPE call would otherwise sit silent that long: the
build is logged at INFO when it starts and ends, and ``liteboost build-cpu-kernel`` does it ahead
of time (:func:`build_cpu_extension`). The compiler flags follow the vector ISA torch dispatches
to (:func:`build_config`), and the name, which is the cache key, covers flags, source and torch
version (:func:`build_name`). Builds are cached per Python ABI and torch installation under
torch's extension root (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``;
:func:`extension_directory`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from liteboost import env

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "block_sparse_attention.cpp"
"""The extension's one C++ source file."""

# -ffast-math lets the compiler vectorise expf through glibc's libmvec; the kernel avoids
# infinities.
_CFLAGS = ("-O3", "-ffast-math", "-fopenmp")

# x86 vector ISAs, as torch's dispatcher names them, and the compiler flags for exactly the
# features that dispatch level requires (ATen checks the same cpuinfo bits before choosing it).
_X86_ISA_FLAGS = {
    "AVX512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"),
    "AVX2": ("-mavx2", "-mfma"),
}
_X86 = ("x86_64", "amd64", "i686", "i386")
_ARM64 = ("aarch64", "arm64")


@dataclass(frozen=True)
class BuildConfig:
    """How the kernel is compiled for one machine: a readable tag and the compiler flags."""

    tag: str
    cflags: tuple[str, ...]


def build_config(capability: str, machine: str) -> BuildConfig:
    """Compiler flags that follow the vector ISA torch itself runs at on this machine.

    Args:
        capability: ``torch.backends.cpu.get_cpu_capability()`` ("AVX512", "AVX2", "DEFAULT",
            "SVE256", ...). Following torch rather than the CPU means an ISA cap
            (``ATEN_CPU_CAPABILITY=avx2``) caps this kernel too, and a CPU torch does not
            trust with a level never gets code for it.
        machine: ``platform.machine()``.

    Returns:
        x86: AVX-512 (F/BW/VL/DQ + FMA) when torch dispatches AVX512, AVX2 + FMA when it
        dispatches AVX2, the x86-64 baseline otherwise. aarch64: no ISA flags (NEON is part of
        the baseline, and the compiler vectorises expf with it). Anything else: portable
        flags only. The vectorised exp matters: the x86-64 baseline build measured 1.3-1.6x
        slower than AVX2.
    """
    arch = machine.lower()
    if arch in _X86:
        level = capability.upper()
        if level in _X86_ISA_FLAGS:
            return BuildConfig(f"x86_{level.lower()}", _CFLAGS + _X86_ISA_FLAGS[level])
        return BuildConfig("x86_baseline", _CFLAGS)
    if arch in _ARM64:
        return BuildConfig("aarch64", _CFLAGS)
    safe = "".join(c if c.isalnum() else "_" for c in arch) or "unknown"
    return BuildConfig(f"{safe}_portable", _CFLAGS)


def build_name(config: BuildConfig, source: str, torch_version: str) -> str:
    """Extension name: the build cache key, so it covers everything that changes the binary.

    The tag and a digest of the flags, the kernel source and the torch version (its headers and
    ABI). Machines sharing a cache directory, or a liteboost upgrade, never load a binary built
    for something else, and never rebuild each other's in turn.
    """
    digest = hashlib.sha256("\0".join((*config.cflags, source, torch_version)).encode())
    return f"liteboost_block_sparse_{config.tag}_{digest.hexdigest()[:12]}"


def extension_directory(name: str, torch_location: str | None = None) -> Path:
    """Where the extension ``name`` is built and cached.

    ``<torch extension root>/liteboost/py<X><Y><abiflags>/<name>/torch-<digest>``: the root is
    torch's (``TORCH_EXTENSIONS_DIR`` moves it); the Python tag keeps interpreters with different
    ABIs apart, which the name does not cover; the last folder is per torch installation
    (``torch_location``, default the imported torch's folder). The build command names that
    installation's header folders, so environments sharing one folder (a virtual environment
    per test session, say) would each see a changed command and rebuild the others' binary in
    turn, a minute each time; with a folder each, every environment builds once. liteboost
    picks the folder itself, rather than leaving it to torch, so that it knows before loading
    whether a build is due.
    """
    from torch.utils.cpp_extension import get_default_build_root

    root = env.read(env.TORCH_EXTENSIONS_DIR) or get_default_build_root()
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    location = torch_location or str(Path(torch.__file__).resolve().parent)
    installation = f"torch-{hashlib.sha256(location.encode()).hexdigest()[:8]}"
    return Path(root) / "liteboost" / python / name / installation


@dataclass(frozen=True)
class CpuExtension:
    """The loaded extension and how it got here.

    Attributes:
        module: the extension module (``block_sparse_attention``, ``rope_rotate``).
        name: its name, the build cache key.
        tag: the build's vector-ISA tag (``x86_avx2``, ``aarch64``, ...).
        library: the shared library the module was loaded from.
        built: True when this call compiled it, False when it was loaded from the cache.
        seconds: wall time of the build or load.
    """

    module: ModuleType
    name: str
    tag: str
    library: Path
    built: bool
    seconds: float


def _ensure_ninja() -> None:
    # torch runs the ``ninja`` on PATH; the ninja wheel's own is found when the venv is not
    # activated.
    if shutil.which("ninja") is None:
        import ninja

        env.prepend_path(ninja.BIN_DIR)


def _mtime(path: Path) -> float | None:
    return path.stat().st_mtime if path.exists() else None


def build_cpu_extension() -> CpuExtension:
    """Build the extension for this machine, or load it when the cache already holds it.

    Logs at INFO when a build starts (it takes about a minute) and when it ends.

    Raises:
        Exception: whatever the toolchain or the loader raised (no compiler, no BLAS symbol,
            ...); :func:`load_cpu_kernel` turns that into the torch fallbacks.
    """
    from torch.utils.cpp_extension import load

    _ensure_ninja()
    config = build_config(torch.backends.cpu.get_cpu_capability(), platform.machine())
    name = build_name(config, SOURCE.read_text(), torch.__version__)
    directory = extension_directory(name)
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"{name}.so"
    before = _mtime(library)
    if before is None:
        logger.info(
            "building liteboost's CPU kernel extension %s in %s: about a minute, once per "
            "machine, vector ISA and torch version ('liteboost build-cpu-kernel' does it ahead "
            "of time)",
            name,
            directory,
        )
    start = time.perf_counter()
    module = load(
        name=name,
        sources=[str(SOURCE)],
        extra_cflags=list(config.cflags),
        extra_ldflags=["-lm"],
        build_directory=str(directory),
    )
    seconds = time.perf_counter() - start
    built = _mtime(library) != before
    if built:
        logger.info("built liteboost's CPU kernel extension %s in %.1f s", name, seconds)
    else:
        logger.debug("loaded liteboost's CPU kernel extension %s from %s", name, directory)
    return CpuExtension(module, name, config.tag, Path(module.__file__ or library), built, seconds)


@functools.cache
def load_cpu_kernel() -> ModuleType | None:
    """The extension module (built on first use), or None where it cannot be built or loaded.

    Cached per process. None is logged once as a warning with the reason; the callers then run
    their torch fallbacks (block gather, the torch RoPE form).
    """
    try:
        return build_cpu_extension().module
    except Exception as exc:  # any toolchain or loader failure means: use the fallback
        logger.warning("CPU kernel extension unavailable, using the torch fallbacks: %s", exc)
        return None
