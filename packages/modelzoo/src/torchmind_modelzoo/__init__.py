"""modelzoo: 100 model cards in six categories, with conversion configs and tiny runnable examples.

Importing modelzoo reads no card and imports neither transformers nor diffusers; each category's
library is needed only to build, convert or run its models.
"""

from importlib.metadata import version

from torchmind_modelzoo import registry
from torchmind_modelzoo.schema import (
    Attention,
    Category,
    ConvertConfig,
    ExampleConfig,
    ModelCard,
    Parallelism,
    Status,
    Task,
)
from torchmind_modelzoo.validate import CardError

__version__ = version("torchmind-modelzoo")

__all__ = [
    "Attention",
    "CardError",
    "Category",
    "ConvertConfig",
    "ExampleConfig",
    "ModelCard",
    "Parallelism",
    "Status",
    "Task",
    "__version__",
    "registry",
]
