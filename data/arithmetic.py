"""Write data/arithmetic_train.jsonl and data/arithmetic_test.jsonl: "What is a + b?" at
the four levels of experiments/lossy.py, with no instruction about the answer's form, so the
target answers in its own templated sentences ("To add 23 and 45, we ...") that repeat the
prompt's numbers. A domain where a small draft can learn to predict most of what the target
writes: the high-acceptance regime in which VAT's weighting acts (it changes nothing on a chain rejected at its first token).

    python data/arithmetic.py            # deterministic: the same files on every machine

The test prompts are drawn first and never appear in the training file; neither file holds a
problem of lossy.py's own evaluation (seed 0), which adds "Reply with the number only.".
"""
import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "experiments")]
from tasks import LEVELS, arithmetic_problems  # noqa: E402  (the levels experiments/lossy.py grades)

TEST_PER_LEVEL = 25
TRAIN_PER_LEVEL = 3000  # levels with fewer distinct problems give all they have left


def distinct_problems(level: str, n: int, rng: random.Random, taken: set) -> list:
    """Up to n problems of a level not in `taken` (which grows), in draw order."""
    found, tries = [], 0
    while len(found) < n and tries < 100 * n:
        tries += 1
        a, b = LEVELS[level](rng)
        prompt = f"What is {a} + {b}?"
        if prompt not in taken:
            taken.add(prompt)
            found.append({"prompt": prompt, "level": level, "answer": str(a + b)})
    return found


def main():
    # lossy.py's evaluation problems, without their instruction, are kept out of both files
    taken = {p["prompt"].split("?")[0] + "?" for p in arithmetic_problems(100, seed=0)}
    splits = {"test": TEST_PER_LEVEL, "train": TRAIN_PER_LEVEL}
    for split, per_level in splits.items():
        rows = []
        for level in LEVELS:
            rows += distinct_problems(level, per_level, random.Random(f"arithmetic-{split}:{level}"), taken)
        random.Random(f"arithmetic-{split}").shuffle(rows)
        path = HERE / f"arithmetic_{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{path.name}: {len(rows)} prompts")


if __name__ == "__main__":
    main()
