"""Per-token statistics of a linear head's next-token distribution, without its logits: the
entropy and whether the label is the most likely token (TRL logs their means as ``entropy``
and ``mean_token_accuracy``).

One pass over the vocabulary in blocks, as the fused loss's forward walks it: at most
``BLOCK_TOKENS x BLOCK_VOCAB`` fp32 logits (16 MiB) and a few temporaries of that size exist
at a time, with a running maximum, sum of exponentials and exponential-weighted sum of logits
per token (an online entropy) and a running first argmax. Only counted tokens (label not
``ignore_index``) are scored. No gradient: the values are for logging. It costs one more
product of the counted tokens' hidden states with the head (the fused loss does four:
forward, and backward's recomputation, input and weight gradients).

Logits are formed in fp32 on the CPU (as the fused loss forms them) and in the model's
dtype with fp32 accumulation on a GPU (as TRL's own head forms them), outside autocast.
"""

from __future__ import annotations

import torch

BLOCK_TOKENS = 1024
BLOCK_VOCAB = 4096


@torch.no_grad()
def token_metrics(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """(entropy, is_top1) of ``softmax(hidden @ weight.T)`` per position of ``labels``
    (``hidden.shape[:-1]``): fp32 entropy in nats, and whether the label is the first index
    of the largest logit; 0 and False where the label is ``ignore_index``."""
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1).to(flat_hidden.device)
    entropy = torch.zeros(flat_labels.shape, dtype=torch.float32, device=flat_hidden.device)
    is_top1 = torch.zeros(flat_labels.shape, dtype=torch.bool, device=flat_hidden.device)
    counted = torch.nonzero(flat_labels != ignore_index).squeeze(1)
    compute = flat_hidden.dtype if flat_hidden.device.type == "cuda" else torch.float32
    vocab = weight.shape[0]
    with torch.autocast(flat_hidden.device.type, enabled=False):
        for t0 in range(0, counted.numel(), BLOCK_TOKENS):
            rows = counted[t0 : t0 + BLOCK_TOKENS]
            h = flat_hidden[rows].to(compute)
            n = rows.numel()
            running_max = torch.full((n,), -torch.inf, device=h.device)
            sum_exp = torch.zeros(n, device=h.device)
            # sum over the vocabulary of exp(z - running_max) * (z - running_max)
            weighted = torch.zeros(n, device=h.device)
            best = torch.full((n,), -torch.inf, device=h.device)
            best_index = torch.zeros(n, dtype=torch.int64, device=h.device)
            for v0 in range(0, vocab, BLOCK_VOCAB):
                logits = (h @ weight[v0 : v0 + BLOCK_VOCAB].to(compute).T).float()
                block_max, block_index = logits.max(dim=1)  # first index of the maximum
                later_is_larger = block_max > best  # ties keep the earlier index
                best_index = torch.where(later_is_larger, block_index + v0, best_index)
                best = torch.maximum(best, block_max)
                new_max = torch.maximum(running_max, block_max)
                shift = running_max - new_max  # -inf before the first block
                rescale = torch.exp(shift)
                # Re-based on new_max: sum e^(z-m') (z-m') = e^(m-m') (weighted + (m-m') sum).
                carried = torch.where(sum_exp > 0, weighted + shift * sum_exp, 0.0)
                centred = logits.sub_(new_max[:, None])
                exps = centred.exp()
                # Row-wise dot products as a batched matmul: no block-sized product.
                dots = torch.bmm(exps.unsqueeze(1), centred.unsqueeze(2)).view(n)
                weighted = rescale * carried + dots
                sum_exp = rescale * sum_exp + exps.sum(dim=1)
                running_max = new_max
            # H = -sum p log p with p = e^(z-m) / s: log s - weighted / s.
            entropy[rows] = torch.log(sum_exp) - weighted / sum_exp
            is_top1[rows] = best_index == flat_labels[rows]
    return entropy.view(labels.shape), is_top1.view(labels.shape)
