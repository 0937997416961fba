"""Writes corpus.txt, the demo's training text: generated, so free of any licence.

    python -m bench.data.make_corpus

Sentences about small numbers in words ("seven plus five is twelve.", "nine is more than
four.", "after eleven comes twelve."), from a fixed seed. A character-level model can learn
their spelling, their grammar and, slowly, the arithmetic: held-out sentences (other number
pairs) measure what it learned rather than what it memorised.
"""

from __future__ import annotations

import random
from pathlib import Path

WORDS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
]
PATH = Path(__file__).with_name("corpus.txt")


def sentences(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    n = len(WORDS)
    for a in range(n):
        for b in range(n):
            if a + b < n:
                out.append(f"{WORDS[a]} plus {WORDS[b]} is {WORDS[a + b]}.")
            if a >= b:
                out.append(f"{WORDS[a]} minus {WORDS[b]} is {WORDS[a - b]}.")
            if a != b:
                rel = "more" if a > b else "less"
                out.append(f"{WORDS[a]} is {rel} than {WORDS[b]}.")
        if a + 1 < n:
            out.append(f"after {WORDS[a]} comes {WORDS[a + 1]}.")
            out.append(f"before {WORDS[a + 1]} comes {WORDS[a]}.")
        if a + 3 < n:
            out.append(f"counting: {', '.join(WORDS[a : a + 4])}.")
    rng.shuffle(out)
    return out


def main() -> None:
    PATH.write_text("\n".join(sentences()) + "\n")
    print(f"wrote {PATH} ({PATH.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
