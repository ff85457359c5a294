"""The models of the examples. Each is small enough to train on a laptop CPU in seconds."""
import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """The DDP tutorial's model: a small regression network (upstream uses nn.Linear(20, 1))."""

    def __init__(self, input_size=20, hidden_size=64, output_size=1):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(input_size, hidden_size), nn.ReLU(),
            nn.Linear(hidden_size, hidden_size), nn.ReLU(),
            nn.Linear(hidden_size, output_size),
        )

    def forward(self, x):
        return self.net(x)


class Block(nn.Module):
    """One residual MLP block, as in a transformer: x + fc2(relu(fc1(norm(x))))."""

    def __init__(self, width, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.fc2(F.relu(self.fc1(self.norm(x))))


class BlockMLP(nn.Module):
    """The tutorial's regression network made of repeated blocks (fsdp.py): an input layer, `depth` residual
    blocks, a norm and an output layer. FSDP shards it block by block."""

    def __init__(self, input_size=20, width=64, hidden=256, depth=4, output_size=1):
        super().__init__()
        self.inp = nn.Linear(input_size, width)
        self.blocks = nn.ModuleList(Block(width, hidden) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, output_size)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x))


class LinearClassifier(nn.Module):
    """Logistic regression: one linear layer from the features to the class logits."""

    def __init__(self, input_size, num_classes=2):
        super().__init__()
        self.linear = nn.Linear(input_size, num_classes)

    def forward(self, x):
        return self.linear(x)


class SimpleCNN(nn.Module):
    """Two conv blocks and two fully connected layers for 28x28 digits, in the Hugging Face model style:
    forward(image, labels=None) returns {"loss", "logits"} with labels and {"logits"} without."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(64 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, image, labels=None):
        x = F.max_pool2d(F.relu(self.conv1(image)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        # Raw logits: a ReLU here (as upstream has) clamps every negative logit to zero and cripples training.
        logits = self.fc2(x)
        if labels is None:
            return {"logits": logits}
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}
