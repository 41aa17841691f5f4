"""Tiny llama-style transformer for CPU demos of tensor parallel and FSDP2.

Pure torch; `parallelize` applies TP (and optionally 2-D FSDP2+TP) on gloo/CPU meshes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "Attention",
    "FeedForward",
    "ModelArgs",
    "RMSNorm",
    "Transformer",
    "TransformerBlock",
    "make_batch",
    "parallelize",
    "train_step",
]


@dataclass
class ModelArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    vocab_size: int = 128
    max_seq_len: int = 32
    ffn_hidden: int = 128


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed * self.weight


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        assert args.dim % args.n_heads == 0
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # Under ColwiseParallel the projections return local shards, so the
        # number of (local) heads is inferred from the last dim via -1.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        mask = torch.ones(seqlen, seqlen, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        probs = F.softmax(scores.float(), dim=-1).type_as(q)
        out = (probs @ v).transpose(1, 2).reshape(bsz, seqlen, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_hidden, bias=False)
        self.w2 = nn.Linear(args.ffn_hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs | None = None, seed: int = 0):
        super().__init__()
        self.args = args = args or ModelArgs()
        torch.manual_seed(seed)  # identical init on every rank
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: int64 [batch, seq] -> logits float [batch, seq, vocab] (a tensor of its own, not a view)."""
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        # Tensor parallel's output is a view (DTensor.to_local): FSDP2 warns when its root returns one, since an
        # in-place op on it would skip the pre-backward hook. A copy of [batch, seq, vocab] costs nothing here.
        return self.output(self.norm(h)).clone()


def parallelize(model: Transformer, tp_mesh, dp_mesh=None) -> Transformer:
    """Apply tensor parallel on 1-D `tp_mesh`; if `dp_mesh` is given, also FSDP2 (2-D).

    TP plan (llama style, norms replicated): wq/wk/wv/w1/w3 colwise, wo/w2 rowwise,
    tok_embeddings rowwise (replicated input), output colwise (replicated logits).
    FSDP2 `fully_shard` is applied per TransformerBlock and to the root, after TP.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    block_plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    for block in model.layers:
        parallelize_module(block, tp_mesh, block_plan)

    if dp_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model


def make_batch(
    args: ModelArgs, batch_size: int, step: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic (tokens, targets), int64 [batch, seq], same on every rank.

    Each row counts up from a random start ("next = token + 1 mod vocab"), so loss drops.
    Uses a private generator; global RNG state is untouched.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    seq = args.max_seq_len
    start = torch.randint(0, args.vocab_size, (batch_size, 1), generator=g)
    ramp = torch.arange(seq + 1).unsqueeze(0)
    data = (start + ramp) % args.vocab_size
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tokens: torch.Tensor,
    targets: torch.Tensor,
) -> float:
    """One step: cross-entropy on tokens/targets (int64 [batch, seq]); returns loss."""
    logits = model(tokens)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if hasattr(loss, "full_tensor"):
        loss = loss.full_tensor()
    return float(loss.detach().item())
