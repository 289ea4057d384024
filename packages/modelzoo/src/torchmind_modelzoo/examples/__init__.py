"""Runnable inference examples, one class per task; ``example_for(card)`` picks the right one."""

from torchmind_modelzoo.examples.base import Example, ExportWrapper, example_for

__all__ = ["Example", "ExportWrapper", "example_for"]
