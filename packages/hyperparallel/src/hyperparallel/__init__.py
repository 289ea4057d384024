"""hyperparallel: distributed Muon on FSDP2/HSDP and the ``hyperparallel train`` job."""

from importlib.metadata import version

__version__ = version("torchmind-hyperparallel")

__all__ = ["__version__"]
