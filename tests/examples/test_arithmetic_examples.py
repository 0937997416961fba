"""The GRPO and DPO arithmetic examples: their reward rule on hand-made completions, the task
and the pairs, the character tokenizer against the model's own ids, the completion
log-probabilities against a character-by-character reference, and each example end to end
in a tiny form (two steps) with its figures checked against what they are computed from."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from support.dependencies import require

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None

import arithmetic_common as common  # noqa: E402

from bench.common.char_model import char_ids, corpus_parts  # noqa: E402
from bench.data.make_corpus import WORDS  # noqa: E402


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        (" ten.", "ten", 1.0),
        (" ten.\nfour plus", "ten", 1.0),  # what follows the full stop is not read
        ("ten", "ten", 1.0),  # cut at the length limit before its full stop
        (" ten\n", "ten", 1.0),
        (" tens.", "ten", 0.0),
        (" ten is", "ten", 0.0),
        (" nine.", "ten", 0.0),  # a near miss earns nothing
        (" seventeen.", "seven", 0.0),
        (" seven teen.", "seventeen", 0.0),
        ("", "ten", 0.0),
        (".", "ten", 0.0),
    ],
)
def test_reward_rule_on_hand_made_completions(completion: str, answer: str, expected: float):
    assert common.correct(completion, answer) == expected


def test_grpo_reward_function_applies_the_rule_per_completion():
    import grpo_arithmetic

    got = grpo_arithmetic.reward([" two.", " one.", "two"], answer=["two", "two", "three"])
    assert got == [1.0, 0.0, 0.0]


def test_task_sums_are_right_and_the_held_out_ones_unseen():
    train, held = common.task_sentences()
    assert train and set(train).isdisjoint(held)
    _, task, corpus_held = corpus_parts()
    assert set(train) <= set(task) and set(held) <= set(corpus_held)
    for sentence in train + held:
        p = common.problem(sentence)
        a, plus, b, is_ = p.prompt.split()
        assert (plus, is_) == ("plus", "is")
        assert WORDS.index(p.answer) == WORDS.index(a) + WORDS.index(b) <= common.MAX_SUM
        assert f"{p.prompt} {p.answer}." == sentence


def test_char_tokenizer_gives_the_models_ids():
    require("transformers")
    tok = common.char_tokenizer()
    sentences = corpus_parts()[1][:20] + ["tab\there, é, two\n\nlines"]
    for s in sentences:
        ids = tok(s)["input_ids"]
        assert ids == char_ids([s]).tolist()[:-1]  # char_ids closes the text with a line end
        if s.isascii():
            assert tok.decode(ids) == s
    assert tok.eos_token_id == ord("\n") and tok.pad_token_id == 0


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    require("transformers")
    return common.pretrained_model(torch.float32)


def reference_log_prob(model: torch.nn.Module, prompt: str, completion: str) -> float:
    """Each character of the completion and the closing line end scored by a forward over
    exactly its prefix, summed in float64."""
    ids = char_ids([prompt + completion])
    total = 0.0
    with torch.no_grad():
        for j in range(len(prompt), ids.numel()):
            logits = model(input_ids=ids[None, :j]).logits[0, -1].double()
            total += float(torch.log_softmax(logits, -1)[ids[j]])
    return total


def test_completion_log_probs_match_a_character_by_character_reference(model):
    # Uneven lengths, so that the batched computation pads all but the longest.
    prompts = ["seven plus three is", "two plus two is", "a", "twelve plus five is"]
    completions = [" ten.", " nineteen.", "", " seventeen."]
    got = common.completion_log_probs(model, prompts, completions)
    for value, p, c in zip(got.tolist(), prompts, completions, strict=True):
        # fp32 logits over at most 30 positions: log-softmax within ~1e-5 each, summed.
        assert value == pytest.approx(reference_log_prob(model, p, c), abs=1e-4)


def test_dpo_pairs_and_held_out_accuracy(model):
    import dpo_arithmetic

    problems = [common.problem(s) for s in common.task_sentences(max_sum=20)[0][:12]]
    rows = dpo_arithmetic.pairs(problems, seed=3, per_problem=3)
    assert len(rows) == 36 and rows == dpo_arithmetic.pairs(problems, seed=3, per_problem=3)
    for i, row in enumerate(rows):
        p = problems[i // 3]
        assert row["prompt"] == p.prompt and row["chosen"] == f" {p.answer}."
        wrong = row["rejected"].strip(" .")
        assert wrong in WORDS and wrong != p.answer
    assert len({r["rejected"] for r in rows[:3]}) == 3  # distinct wrong answers per problem
    wins = [
        reference_log_prob(model, r["prompt"], r["chosen"])
        > reference_log_prob(model, r["prompt"], r["rejected"])
        for r in rows[:8]
    ]
    assert dpo_arithmetic.held_out_accuracy(model, rows[:8]) == sum(wins) / 8


def test_grpo_example_end_to_end(tmp_path, monkeypatch):
    """Two GRPO steps with Lomo: the printed curve is the mean of the rewards each step's
    completions got, the policy moved, and the plot and the curves are written."""
    require("trl")
    import grpo_arithmetic

    given: list[list[float]] = []
    rule = grpo_arithmetic.reward

    def recorded(completions, answer, **kw):
        # The rule's reward, plus a half for an odd-length completion: two warm-up steps
        # leave every answer wrong (every group's rewards equal, so no advantage and no
        # gradient); this gives the groups' completions different rewards to learn from.
        out = [r + 0.5 * (len(c) % 2) for r, c in zip(rule(completions, answer, **kw),
                                                      completions, strict=True)]  # fmt: skip
        given.append(out)
        return out

    recorded.__name__ = "reward"
    monkeypatch.setattr(grpo_arithmetic, "reward", recorded)
    built = []  # the warm-up's model, then GRPO's (loaded from the warm-up's end)
    pretrained = grpo_arithmetic.pretrained_model
    monkeypatch.setattr(
        grpo_arithmetic, "pretrained_model", lambda *a: built.append(pretrained(*a)) or built[-1]
    )
    plot, out = tmp_path / "grpo.png", tmp_path / "grpo.json"
    curves = grpo_arithmetic.main(
        [
            "--steps",
            "2",
            "--warm-up-steps",
            "2",
            "--optimizers",
            "lomo",
            "--dtype",
            "fp32",
            "--plot",
            str(plot),
            "--json",
            str(out),
        ]  # fmt: skip
    )
    assert list(curves) == ["lomo"] and len(curves["lomo"]) == 2
    # One generation batch per step (steps_per_generation = the 2 micro-batches).
    per_step = grpo_arithmetic.PROMPTS * grpo_arithmetic.GENERATIONS * 2
    assert [len(g) for g in given] == [per_step, per_step]
    for logged, rewards in zip(curves["lomo"], given, strict=True):
        assert logged == pytest.approx(math.fsum(rewards) / len(rewards), abs=1e-6)
    assert json.loads(out.read_text())["curves"] == curves
    assert plot.exists() == HAS_MATPLOTLIB
    # Lomo's steps moved the policy from where the warm-up left it.
    warmed, trained = built
    moved = [not torch.equal(a, b) for a, b in zip(warmed.parameters(), trained.parameters(),
                                                   strict=True)]  # fmt: skip
    assert any(moved)


def test_grpo_example_refuses_an_unknown_optimizer():
    import grpo_arithmetic

    with pytest.raises(SystemExit, match="choose from lomo, adamw"):
        grpo_arithmetic.main(["--optimizers", "sgd"])


def test_dpo_example_end_to_end(tmp_path, model):
    """Two DPO steps with Lomo on fp32 weights: at the first step the policy is its reference,
    so every pair's DPO rewards tie (accuracy 0, margin 0); the held-out accuracy before is
    the pretrained model's, recomputed here; curves and plot written."""
    require("trl")
    import dpo_arithmetic

    plot, out = tmp_path / "dpo.png", tmp_path / "dpo.json"
    result = dpo_arithmetic.main(
        ["--steps", "2", "--dtype", "fp32", "--plot", str(plot), "--json", str(out)]
    )
    assert len(result["accuracy"]) == len(result["margin"]) == 2
    assert result["accuracy"][0] == 0 and result["margin"][0] == 0
    # The first step moved the policy off its reference: the second step's rewards differ.
    assert result["margin"][1] != 0
    assert all(0 <= a <= 1 for a in result["accuracy"])
    _, held = common.task_sentences(max_sum=20)
    rows = dpo_arithmetic.pairs([common.problem(s) for s in held], 1, per_problem=4)
    assert result["held_out_before"] == dpo_arithmetic.held_out_accuracy(model, rows)
    assert 0 <= result["held_out_after"] <= 1
    assert json.loads(out.read_text()) == result
    assert plot.exists() == HAS_MATPLOTLIB
