"""Linear + cross-entropy in blocks of torch operations (the CPU kernel, and the fallback on
any device without Triton).

The forward walks the vocabulary in blocks per block of tokens, keeping a running maximum
and sum of exponentials (an online log-sum-exp): at most ``block_tokens x block_vocab`` fp32
logits exist at a time. The backward, given one chunk of the vocabulary, recomputes that
chunk's logits in the same blocks from the saved log-sum-exp, adds the chunk's share of
``d_hidden`` into an fp32 accumulator and writes the chunk's complete weight gradient.

Logits are computed in fp32 from fp32 copies of each block (a bf16/fp16 model's unfused
head rounds them to its dtype first; these are the more precise values), and divided by the
temperature inside the block (sampling's ``logits / temperature``, as TRL's GRPO scores its
completions).
"""

from __future__ import annotations

import torch

# A block of logits is block_tokens x block_vocab fp32 values: 4 Mi elements, 16 MiB.
BLOCK_TOKENS = 1024
BLOCK_VOCAB = 4096


def _block_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = hidden.float() @ weight.float().T
    return logits if temperature == 1.0 else logits.div_(temperature)


def forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, lse): per-token fp32 loss (0 where ignored) and log-sum-exp of the logits over
    `temperature`."""
    tokens, vocab = hidden.shape[0], weight.shape[0]
    loss = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
    lse = torch.empty_like(loss)
    for t0 in range(0, tokens, BLOCK_TOKENS):
        t1 = min(t0 + BLOCK_TOKENS, tokens)
        h, lab = hidden[t0:t1], labels[t0:t1]
        running_max = torch.full((t1 - t0,), -torch.inf, device=hidden.device)
        running_sum = torch.zeros_like(running_max)
        target = torch.zeros_like(running_max)
        for v0 in range(0, vocab, BLOCK_VOCAB):
            v1 = min(v0 + BLOCK_VOCAB, vocab)
            logits = _block_logits(h, weight[v0:v1], temperature)
            in_block = (lab >= v0) & (lab < v1)
            column = torch.where(in_block, lab - v0, 0)
            target += torch.where(in_block, logits.gather(1, column[:, None]).squeeze(1), 0.0)
            new_max = torch.maximum(running_max, logits.amax(dim=1))
            # In place: one block of logits is the only block-sized buffer.
            block_sum = logits.sub_(new_max[:, None]).exp_().sum(dim=1)
            running_sum = running_sum * torch.exp(running_max - new_max) + block_sum
            running_max = new_max
        block_lse = running_max + torch.log(running_sum)
        lse[t0:t1] = block_lse
        loss[t0:t1] = torch.where(lab != ignore_index, block_lse - target, 0.0)
    return loss, lse


def backward_chunk(
    grad_loss: torch.Tensor,
    hidden: torch.Tensor,
    weight_chunk: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    vocab_start: int,
    d_hidden: torch.Tensor | None,
    d_weight_chunk: torch.Tensor | None,
    temperature: float = 1.0,
) -> None:
    """For the vocabulary rows ``[vocab_start, vocab_start + len(weight_chunk))``: adds their
    share of the input gradient into ``d_hidden`` (fp32, tokens x hidden) and writes their
    weight gradient into ``d_weight_chunk`` (fp32, chunk x hidden); either may be None, and
    its products are then skipped. ``grad_loss`` is the per-token gradient, already 0 on
    ignored tokens. The logits are over `temperature`, as in the forward (their gradient
    carries its ``1 / temperature``)."""
    tokens, chunk = hidden.shape[0], weight_chunk.shape[0]
    weight32 = weight_chunk.float()
    if temperature != 1.0:
        grad_loss = grad_loss / temperature
    if d_weight_chunk is not None:
        d_weight_chunk.zero_()
    for t0 in range(0, tokens, BLOCK_TOKENS):
        t1 = min(t0 + BLOCK_TOKENS, tokens)
        h32 = hidden[t0:t1].float()
        # Vocabulary blocks within the chunk: one block of logits at a time, as the forward.
        for v0 in range(0, chunk, BLOCK_VOCAB):
            v1 = min(v0 + BLOCK_VOCAB, chunk)
            w32 = weight32[v0:v1]
            probs = _block_logits(h32, w32, temperature).sub_(lse[t0:t1, None]).exp_()
            column = labels[t0:t1] - (vocab_start + v0)
            rows = torch.nonzero((column >= 0) & (column < v1 - v0)).squeeze(1)
            probs[rows, column[rows]] -= 1.0
            probs *= grad_loss[t0:t1, None]
            if d_hidden is not None:
                d_hidden[t0:t1].addmm_(probs, w32)
            if d_weight_chunk is not None:
                d_weight_chunk[v0:v1].addmm_(probs.T, h32)
