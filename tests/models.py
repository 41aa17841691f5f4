"""Small models with known module trees for exact span assertions."""

import torch
from torch import nn


class Block(nn.Module):
    """a -> relu -> b -> relu: the same ReLU instance runs twice per forward."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.b(self.act(self.a(x))))


class TwoBlocks(nn.Module):
    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.l0 = Block(dim)
        self.l1 = Block(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l1(self.l0(x))


class Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")


class MaybeBoom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.boom = Boom()

    def forward(self, x: torch.Tensor, explode: bool = False) -> torch.Tensor:
        x = self.lin(x)
        return self.boom(x) if explode else x


class AllReduceLinear(nn.Module):
    """A linear layer that all-reduces its output in forward (like RowwiseParallel)."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        torch.distributed.all_reduce(out.detach())
        return out


class AllReduceInBackward(torch.autograd.Function):
    """Identity in forward; all-reduces the gradient in backward (as ColwiseParallel's input, or FSDP2's
    post-backward reduce-scatter)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        torch.distributed.all_reduce(grad)
        return grad
