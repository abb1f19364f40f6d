"""A language model of one's own, nanoGPT's shape (runnable: actune maxbatch
docs/examples/nanogpt.py): GPT-2 small's sizes, its own attention block, a head tied to the
token embedding, and a loss of ``F.cross_entropy`` on the flattened logits.

actune recognises the head (a linear layer with the embedding's vocabulary as outputs) and
computes this loss in chunks, the logits never whole (docs/training.md, "A causal LM's head
and loss in chunks").
"""

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

VOCAB = 50304  # GPT-2's 50,257 rounded up to a multiple of 64, as nanoGPT does


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.c_attn, self.c_proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, layers: int = 12, width: int = 768, heads: int = 12,
                 block_size: int = 1024) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, width), nn.Embedding(block_size, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # tied, as GPT-2's

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model(depth: float = 1.0, resolution: int = 512) -> nn.Module:
    return GPT(layers=max(1, round(12 * depth)), block_size=max(1024, resolution))


def make_batch(batch_size: int, resolution: int = 512):
    """Token ids and next-token targets (random: nothing is downloaded)."""
    return (torch.randint(0, VOCAB, (batch_size, resolution)),
            torch.randint(0, VOCAB, (batch_size, resolution)))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
