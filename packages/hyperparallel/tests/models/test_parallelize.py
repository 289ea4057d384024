"""``blocks``: the transformer blocks of a model or pipeline stage, in order."""

from __future__ import annotations

import pytest
from torch import nn

from hyperparallel.models.parallelize import blocks


class _Holder(nn.Module):
    def __init__(self, layers: nn.Module) -> None:
        super().__init__()
        self.layers = layers


def test_blocks_reads_list_and_dict_layers_in_order():
    """A ModuleList (the built-in model) and a ModuleDict (a pipeline stage) give their blocks
    in definition order."""
    a, b, c = nn.Linear(2, 2), nn.Linear(2, 3), nn.Linear(3, 3)
    assert blocks(_Holder(nn.ModuleList([a, b, c]))) == [a, b, c]
    assert blocks(_Holder(nn.ModuleDict({"4": c, "2": a}))) == [c, a]
    assert blocks(_Holder(nn.Sequential(b, a))) == [b, a]


def test_blocks_refuses_other_layer_containers():
    """A ``layers`` that is a single module is refused by name, not iterated as blocks."""
    with pytest.raises(TypeError, match=r"_Holder.layers is a Linear; expected a ModuleList"):
        blocks(_Holder(nn.Linear(2, 2)))
