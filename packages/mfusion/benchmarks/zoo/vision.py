"""Convolutional models: ResNet-18 and the DCGAN generator, written from their papers' layouts."""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.skip(x))


class ResNet18(nn.Module):
    def __init__(self, classes: int = 100) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.MaxPool2d(3, 2, 1),
        )
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.stem(x)).mean((2, 3)))


class DCGANGenerator(nn.Module):
    def __init__(self, nz: int = 64, ngf: int = 32) -> None:
        super().__init__()

        def up(cin: int, cout: int, stride: int, pad: int) -> list[nn.Module]:
            return [
                nn.ConvTranspose2d(cin, cout, 4, stride, pad, bias=False),
                nn.BatchNorm2d(cout),
                nn.ReLU(),
            ]

        self.net = nn.Sequential(
            *up(nz, ngf * 8, 1, 0),
            *up(ngf * 8, ngf * 4, 2, 1),
            *up(ngf * 4, ngf * 2, 2, 1),
            *up(ngf * 2, ngf, 2, 1),
            nn.ConvTranspose2d(ngf, 3, 4, 2, 1, bias=False),
            nn.Tanh(),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)
