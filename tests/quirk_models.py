"""Small hand-written LMs that each do one thing real models do and the hooks must survive."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, D = 96, 32


class _LM(nn.Module):
    """Embedding, a body, a head; ``loss`` as HF models return it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def body(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, input_ids, labels=None):
        logits = self.head(self.body(self.embed(input_ids)))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return {"loss": loss, "logits": logits}


class InplaceOnOutput(_LM):
    """The caller scales and adds to what a submodule returned, in place."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def body(self, h):
        out = self.mlp(h)
        out *= 0.5
        out.add_(h)
        return out


class _MaskInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        x *= torch.sigmoid(self.proj.weight.sum(0))  # its own input, modified in place
        return self.proj(x)


class InplaceOnInput(_LM):
    """A submodule modifies its input in place (the caller's tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, D)
        self.mask = _MaskInPlace()

    def body(self, h):
        return self.mask(self.up(h))


class _Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.classifier = nn.Linear(D, 4, bias=False)
        self.conv1d = nn.Conv1d(D, D, 3, groups=D, padding=2)


class ParentReadsChild(_LM):
    """Reads children's weights without calling the children."""

    def __init__(self) -> None:
        super().__init__()
        self.router = _Router()
        self.out = nn.Linear(4, D)

    def body(self, h):
        weight = self.router.conv1d.weight.squeeze(1)             # (D, 3)
        mixed = F.conv1d(h.transpose(1, 2), weight.unsqueeze(1), groups=D, padding=2)[..., : h.shape[1]]
        scores = F.linear(mixed.transpose(1, 2), self.router.classifier.weight)
        return h + self.out(torch.softmax(scores, -1))


class _Scaled(nn.Module):
    """Owns a parameter and calls an inner module: both chunks are in use at once."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(D) + 0.01 * torch.randn(D))
        self.bias = nn.Parameter(torch.zeros(D, D))
        self.inner = inner

    def forward(self, x):
        return self.inner(x * self.scale) + x @ self.bias


class DeepNesting(_LM):
    """Three levels, each owning a chunk: three chunks are pinned at the innermost call."""

    def __init__(self) -> None:
        super().__init__()
        self.block = _Scaled(_Scaled(nn.Linear(D, D)))

    def body(self, h):
        return self.block(h)


class HugeEmbedding(_LM):
    """An embedding of VOCAB x D = 3072 elements, larger than the chunk_size used with it."""

    def __init__(self) -> None:
        super().__init__()
        self.mid = nn.Linear(D, D)

    def body(self, h):
        return torch.tanh(self.mid(h))


class _RMSNorm(nn.Module):
    """Reads its input twice (the mean square and the product): autograd sums two terms
    for the input's gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(D) + 0.1 * torch.randn(D))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class ResidualIntoNorm(_LM):
    """A pre-norm block: the residual stream enters a norm and is added back around it, and
    the norm's output feeds three projections. The stream's gradient is a sum of terms from
    inside the norm and from the residual path; how autograd groups that sum depends on the
    graph, so identity views at module inputs (hf_elixir's hooks put them there) regroup it
    (issue 27: lfm2 strayed 9x the batch split's distance through this alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = _RMSNorm(), _RMSNorm()
        # no key bias: softmax ignores it, its gradient is rounding noise Adam would amplify
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D, bias=False), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def body(self, h):
        x = self.norm1(h)
        scores = self.q(x) @ self.k(x).transpose(1, 2) / D ** 0.5
        causal = torch.ones(h.shape[1], h.shape[1], dtype=torch.bool).triu(1)
        h = h + torch.softmax(scores.masked_fill(causal, float("-inf")), -1) @ self.v(x)
        return h + self.mlp(self.norm2(h))


QUIRKS = {
    "inplace_output": InplaceOnOutput,
    "inplace_input": InplaceOnInput,
    "parent_reads_child": ParentReadsChild,
    "deep_nesting": DeepNesting,
    "huge_embedding": HugeEmbedding,
    "residual_into_norm": ResidualIntoNorm,
}


def make_quirk(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return QUIRKS[name]()
