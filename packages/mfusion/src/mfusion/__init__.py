"""mfusion: graph fusion inside TorchInductor's post-grad stage, with a torch-mlir bridge.

``mfusion.install()`` makes every later ``torch.compile`` run the hand-written fusion passes and
backend-aware automatic fusion; ``mfusion.report()`` says what was rewritten, refused and why.
"""

from importlib.metadata import PackageNotFoundError, version

from mfusion.backends import mlir_cpu as _mlir_cpu  # noqa: F401  (registers mfusion::mlir_region)
from mfusion.backends.registry import BackendName
from mfusion.config import ConvLayoutPolicy, LinearKernelPolicy, MFusionConfig, PatchConvPolicy
from mfusion.install import compile_options, enabled, install, is_installed, uninstall
from mfusion.machine import MachineProfile
from mfusion.passes import conv_layout as _conv_layout  # noqa: F401  (registers mfusion::convolution)
from mfusion.passes.manager import MFusionPassManager
from mfusion.passes.registry import PASS_REGISTRY
from mfusion.report import GraphReport, Report, clear_report, report

try:
    __version__ = version("torchmind-mfusion")
except PackageNotFoundError:  # running from a source tree without metadata
    __version__ = "0.0.0"

__all__ = [
    "PASS_REGISTRY",
    "BackendName",
    "ConvLayoutPolicy",
    "GraphReport",
    "LinearKernelPolicy",
    "MFusionConfig",
    "MFusionPassManager",
    "MachineProfile",
    "PatchConvPolicy",
    "Report",
    "__version__",
    "clear_report",
    "compile_options",
    "enabled",
    "install",
    "is_installed",
    "report",
    "uninstall",
]
