"""What the GRPO and DPO arithmetic examples share: the pretrained character-level LLaMA of
the demo (bench/common/char_model.py, bench/data/), a tokenizer over its characters for TRL,
the task (sums from the corpus, "seven plus five is" -> "twelve"), the answer rule, the short
supervised warm-up with Lomo, the timing and the plot.

The examples run from the clone's root (`python examples/grpo_arithmetic.py`); this module
puts the root on sys.path so that `bench.common` is importable from there.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the examples import the character model from bench/
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common.char_model import (  # noqa: E402
    build_model,
    char_ids,
    corpus_parts,
    windows,
)
from bench.common.machine import fast_dtype  # noqa: E402
from bench.data.make_corpus import WORDS  # noqa: E402
from bench.quality import PRETRAIN, SIZE, pretrained  # noqa: E402
from lomo_kernels import Lomo  # noqa: E402

VOCAB = 128  # the character model's: ids are code points, 127 for anything above
PAD, EOS = "\x00", "\n"  # a sentence ends with its line
# GRPO's task: the corpus's sums whose result is at most this (28 sentences, 27 of them in
# the fine-tuning split): few enough facts for the 0.8M-parameter model to pick up in a few
# hundred steps.
MAX_SUM = 6
SEQ = 64  # the demo's window length
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class Problem:
    prompt: str  # "seven plus three is"
    answer: str  # "ten"


def problem(sentence: str) -> Problem:
    """'seven plus three is ten.' -> Problem('seven plus three is', 'ten')."""
    prompt, answer = sentence.rstrip(".").rsplit(" ", 1)
    return Problem(prompt, answer)


def is_sum(sentence: str, max_sum: int = len(WORDS) - 1) -> bool:
    """'a plus b is c.' with c <= max_sum."""
    words = sentence.rstrip(".").split()
    return words[1] == "plus" and WORDS.index(words[4]) <= max_sum


def task_sentences(max_sum: int = MAX_SUM) -> tuple[list[str], list[str]]:
    """(training, held-out) sums up to `max_sum`, from the corpus's own fine-tuning split
    (its held-out tenth of the arithmetic sentences stays held out)."""
    _, task, held = corpus_parts()
    return [s for s in task if is_sum(s, max_sum)], [s for s in held if is_sum(s, max_sum)]


def answer_of(completion: str) -> str:
    """The number word a completion gives: its text up to the first full stop or line end."""
    return completion.split(".", 1)[0].split(EOS, 1)[0].strip()


def correct(completion: str, answer: str) -> float:
    """The rule: 1 for the right number word ("twelve." or "twelve"), 0 for anything else.
    No partial credit: a near miss ("eleven") is as wrong as nonsense, so the mean reward
    is the share of right answers."""
    return float(answer_of(completion) == answer)


def char_tokenizer() -> Any:
    """A transformers tokenizer with one token per character, the ids `char_ids` gives."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i): i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=chr(VOCAB - 1)))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join without spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS)


def weights_dtype(name: str) -> torch.dtype:
    """bf16 where this CPU multiplies bf16 natively, fp32 elsewhere ("auto"), or as named."""
    return DTYPES[fast_dtype("cpu") if name == "auto" else name]


def pretrained_model(dtype: torch.dtype) -> torch.nn.Module:
    """The demo's pretrained character model (bench/data/), in `dtype`."""
    model = build_model(SIZE, dtype, PRETRAIN["seed"])
    state = torch.load(pretrained(SIZE, PRETRAIN), weights_only=True)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            t.copy_(state[name])
    for config in (model.config, model.generation_config):  # the tokenizer's, for TRL
        config.pad_token_id, config.eos_token_id = ord(PAD), ord(EOS)
    return model


def warm_up(model: torch.nn.Module, sentences: list[str], steps: int, seed: int = 1) -> None:
    """A short supervised fine-tuning on the task's sentences with Lomo (the demo's learning
    rate, 1.0, clipped at 1.0, cosine to a tenth), so that sampled answers are sometimes
    right: the pretrained model has seen no sums and answers none."""
    if steps <= 0:
        return
    opt = Lomo(model, lr=1.0, clip_grad_norm=1.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps, eta_min=0.1)
    batches: Iterator[torch.Tensor] = windows(char_ids(sentences), SEQ, 4, seed)
    model.train()
    for _ in range(steps):
        ids = next(batches)
        opt.fused_backward(model(input_ids=ids, labels=ids).loss)
        sched.step()


def completion_log_probs(
    model: torch.nn.Module, prompts: Sequence[str], completions: Sequence[str], chunk: int = 256
) -> torch.Tensor:
    """Sum over each completion's characters and the line end that closes it of log p(character
    | the prompt and the characters before it), in fp32, one per (prompt, completion)."""
    rows = [char_ids([p + c]) for p, c in zip(prompts, completions, strict=True)]
    out = []
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for i in range(0, len(rows), chunk):
            part, starts = rows[i : i + chunk], [len(p) for p in prompts[i : i + chunk]]
            # Padded on the right: a causal model's earlier positions do not see the padding.
            ids = torch.nn.utils.rnn.pad_sequence(part, batch_first=True, padding_value=0)
            lp = torch.log_softmax(model(input_ids=ids).logits.float()[:, :-1], -1)
            lp = lp.gather(2, ids[:, 1:, None])[..., 0]  # position t scores character t + 1
            pos = torch.arange(ids.shape[1] - 1)[None]
            lengths = torch.tensor([r.numel() for r in part])[:, None]
            scored = (pos >= torch.tensor(starts)[:, None] - 1) & (pos < lengths - 1)
            out.append((lp * scored).sum(1))
    model.train(was_training)
    return torch.cat(out)


class Clock:
    """Wall time and this process's CPU time (all threads) since it was made."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def elapsed(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu

    def line(self) -> str:
        wall, cpu = self.elapsed()
        threads = torch.get_num_threads()
        return f"{wall:.0f} s of wall time, {cpu:.0f} s of CPU time ({threads} thread(s))"


def common_run_args(output_dir: str, steps: int, seed: int) -> dict[str, Any]:
    """TrainingArguments both examples share: a quiet CPU run logging every step."""
    return dict(
        output_dir=output_dir,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=seed,
        bf16=False,  # the weights carry the dtype; no autocast
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
    )


def logged(trainer: Any, key: str) -> list[float]:
    """The per-step values of `key` in the trainer's log."""
    return [h[key] for h in trainer.state.log_history if key in h]


def plot_curves(curves: dict[str, Sequence[float]], path: str, ylabel: str, title: str) -> bool:
    """One line per curve against the step, into `path` (PNG); False without matplotlib."""
    try:
        from bench.common.plots import _pyplot

        plt = _pyplot()
    except ValueError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, values in curves.items():
        ax.plot(range(1, len(values) + 1), values, marker=".", lw=1, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
