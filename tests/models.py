"""Small models with known module trees for exact span assertions (torch only: tests/test_user_objects.py
loads pickles of them where commdebug_otel cannot be imported)."""

import pickle
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


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


class Checkpointed(nn.Module):
    """``head(checkpoint(block, x))``: the block (default a ``Block``) runs again in backward; ``reentrant``:
    torch's older, reentrant checkpoint."""

    def __init__(self, block: nn.Module | None = None, reentrant: bool = False) -> None:
        super().__init__()
        self.block = block if block is not None else Block()
        self.head = nn.Linear(4, 4)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant))


class Net(nn.Module):
    """``layers`` (default: two ``layer()``) as ``Net.layers.0``, ``Net.layers.1``, ..., called in turn."""

    def __init__(self, layer: Callable[[], nn.Module] = Block, layers: Iterable[nn.Module] | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers if layers is not None else [layer(), layer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


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


class SavesItself(nn.Module):
    """Pickles itself into ``into`` from inside its own call."""

    def __init__(self, into):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.into = into

    def forward(self, x):
        out = self.lin(x)
        self.into.append(pickle.dumps(self))
        return out


class Position(nn.Module):
    """Returns its parameter: a leaf output, which holds our backward-begin hook through the step."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.ones(2, 4))

    def forward(self):
        return self.table


class TwoInputs(nn.Module):
    def forward(self, a, b):
        return a * b


class Hooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.position = Position()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)
        self.mix = TwoInputs()

    def forward(self, x, keep=None):
        h = self.first(x + self.position())
        g = self.second(h)
        if keep is not None:
            keep += [h, g]  # inputs of mix (a multi-grad hook), outputs of first and second
        return self.mix(h, g)


class ToyModel(nn.Module):
    """pytorch/examples' tensor- and sequence-parallel example model (distributed/tensor_parallelism)."""

    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(10, 32)
        self.relu = nn.ReLU()
        self.out_proj = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.relu(self.in_proj(x)))


def toy_plan(style: str) -> dict:
    """The examples' parallelize plans for :class:`ToyModel`.

    ``tp``: tensor_parallel_example.py (in_proj ColwiseParallel, out_proj RowwiseParallel);
    ``sp``: sequence_parallel_example.py (inputs and outputs sharded on the sequence dim 0);
    ``tp_sp_out``: ``tp`` with one layer's style switched: out_proj's output sequence-sharded
    (``RowwiseParallel(output_layouts=Shard(0))``).
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style == "tp":
        return {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}
    if style == "sp":
        return {"in_proj": ColwiseParallel(input_layouts=Shard(0)),
                "out_proj": RowwiseParallel(output_layouts=Shard(0))}
    if style == "tp_sp_out":
        return {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel(output_layouts=Shard(0))}
    raise ValueError(f"unknown style {style!r}")
