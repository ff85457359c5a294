"""The user's model, in a file of its own: blocks of a norm and an MLP, its linears split by tensor parallelism."""
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(self.norm(x))))  # the block's line


class Model(nn.Module):
    def __init__(self, dim=32, depth=2):
        super().__init__()
        self.layers = nn.ModuleList(Block(dim) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)  # the layers' line
        return x
