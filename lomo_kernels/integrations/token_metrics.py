"""Per-token statistics of a linear head's next-token distribution, without its logits: the
entropy, whether the label is the most likely token, ``log(sum_v p_v^2)`` and the mean logit
(TRL's trainers ask for these per token, with no gradient: SFT logs the entropy and token
accuracy, DPO the mean logits and, with WPO weighting, weights by ``log(sum_v p_v^2)``).

One pass over the vocabulary in blocks, as the fused loss's forward walks it: at most
``BLOCK_TOKENS x BLOCK_VOCAB`` fp32 logits (16 MiB) and a few temporaries of that size exist
at a time, with a running maximum, sum of exponentials, exponential-weighted sum of logits
(an online entropy), sum of squared exponentials and sum of logits per token, and a running
first argmax. The logits are divided by the temperature inside each block, as the fused
loss's kernels do. Only counted tokens (label not ``ignore_index``) are scored. It costs one
more product of the counted tokens' hidden states with the head (the fused loss does four:
forward, and backward's recomputation, input and weight gradients).

Logits are formed in fp32 on the CPU (as the fused loss forms them) and in the model's
dtype with fp32 accumulation on a GPU (as TRL's own head forms them), outside autocast.
"""

from __future__ import annotations

import torch

BLOCK_TOKENS = 1024
BLOCK_VOCAB = 4096
# What `token_statistics` computes, as TRL's FusedCausalLMOutput names the fields.
STATISTICS = ("entropy", "is_top1", "log_sum_sq_probs", "mean_logits")


@torch.no_grad()
def token_metrics(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """(entropy, is_top1) of ``softmax(hidden @ weight.T)`` per position of ``labels``
    (``hidden.shape[:-1]``): fp32 entropy in nats, and whether the label is the first index
    of the largest logit; 0 and False where the label is ``ignore_index``."""
    stats = token_statistics(hidden, weight, labels, ignore_index, fields=("entropy", "is_top1"))
    return stats["entropy"], stats["is_top1"]


@torch.no_grad()
def token_statistics(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    *,
    temperature: float = 1.0,
    fields: tuple[str, ...] = STATISTICS,
) -> dict[str, torch.Tensor]:
    """The `fields` (among STATISTICS) of ``softmax(hidden @ weight.T / temperature)`` per
    position of ``labels`` (``hidden.shape[:-1]``): fp32 entropy in nats, whether the label is
    the first index of the largest logit, ``log(sum_v p_v^2)``, the mean over the vocabulary
    of the logits over the temperature; 0 (False) where the label is ``ignore_index``."""
    unknown = set(fields) - set(STATISTICS)
    if unknown:
        raise ValueError(
            f"lomo_kernels: token statistics {sorted(unknown)} are not computed "
            f"(known: {', '.join(STATISTICS)})"
        )
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1).to(flat_hidden.device)
    device = flat_hidden.device
    out = {
        name: torch.zeros(
            flat_labels.shape,
            dtype=torch.bool if name == "is_top1" else torch.float32,
            device=device,
        )
        for name in fields
    }
    counted = torch.nonzero(flat_labels != ignore_index).squeeze(1)
    compute = flat_hidden.dtype if device.type == "cuda" else torch.float32
    with torch.autocast(device.type, enabled=False):
        for t0 in range(0, counted.numel(), BLOCK_TOKENS):
            rows = counted[t0 : t0 + BLOCK_TOKENS]
            h = flat_hidden[rows].to(compute)
            for name, value in _block_rows(h, weight, compute, temperature, fields).items():
                out[name][rows] = value if name != "is_top1" else value == flat_labels[rows]
    return {name: value.view(labels.shape) for name, value in out.items()}


def _block_rows(
    h: torch.Tensor,
    weight: torch.Tensor,
    compute: torch.dtype,
    temperature: float,
    fields: tuple[str, ...],
) -> dict[str, torch.Tensor]:
    """One block of tokens' statistics (``is_top1``: the argmax, compared by the caller)."""
    n, vocab = h.shape[0], weight.shape[0]
    running_max = torch.full((n,), -torch.inf, device=h.device)
    sum_exp = torch.zeros(n, device=h.device)
    # sum over the vocabulary of exp(z - running_max) * (z - running_max)
    weighted = torch.zeros(n, device=h.device)
    sq_sum = torch.zeros(n, device=h.device)  # sum of exp(2 (z - running_max))
    z_sum = torch.zeros(n, device=h.device)
    best = torch.full((n,), -torch.inf, device=h.device)
    best_index = torch.zeros(n, dtype=torch.int64, device=h.device)
    for v0 in range(0, vocab, BLOCK_VOCAB):
        logits = (h @ weight[v0 : v0 + BLOCK_VOCAB].to(compute).T).float()
        if temperature != 1.0:
            logits.div_(temperature)
        if "mean_logits" in fields:
            z_sum += logits.sum(dim=1)
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
        if "log_sum_sq_probs" in fields:
            sq_sum = rescale * rescale * sq_sum + torch.bmm(
                exps.unsqueeze(1), exps.unsqueeze(2)
            ).view(n)
        sum_exp = rescale * sum_exp + exps.sum(dim=1)
        running_max = new_max
    log_sum = torch.log(sum_exp)
    values = {
        # H = -sum p log p with p = e^(z-m) / s: log s - weighted / s.
        "entropy": log_sum - weighted / sum_exp,
        "is_top1": best_index,
        # log sum p^2 = log sum e^(2(z-m)) - 2 log s
        "log_sum_sq_probs": torch.log(sq_sum) - 2 * log_sum,
        "mean_logits": z_sum / vocab,
    }
    return {name: values[name] for name in fields}
