"""
Graded tasks for the lossy-verification experiment: "What is a + b?" by level of difficulty, GSM8K
test questions, HumanEval (its tests run on the answer in sandbox.py), each problem with the rule
that grades a response.
"""
import gzip
import json
import random
import re

from sandbox import run_untrusted

from engine.files import DATA, read_jsonl

# Levels of "What is a + b?", easiest first. At T = 0.5 the default target's plain sampling solves
# a fair share of each level; at T = 1 it rarely solves the harder ones (docs/lossy-arithmetic/), hence 0.5.
LEVELS = {
    "1-digit + 1-digit": lambda rng: (rng.randint(1, 9), rng.randint(1, 9)),
    "tens + tens": lambda rng: (10 * rng.randint(1, 9), 10 * rng.randint(1, 9)),
    "2-digit + 1": lambda rng: (rng.randint(10, 99), 1),
    "2-digit + 2-digit": lambda rng: (rng.randint(10, 99), rng.randint(10, 99)),
}


def arithmetic_problems(n: int, seed: int = 0) -> list:
    """n problems per level, the same ones for a given seed on every machine and Python version."""
    problems = []
    for level, operands in LEVELS.items():
        rng = random.Random(f"arithmetic:{seed}:{level}")  # str seeds hash the same everywhere
        for i in range(n):
            a, b = operands(rng)
            problems.append({"id": f"{level} #{i}", "level": level, "answer": str(a + b),
                             "prompt": f"What is {a} + {b}? Reply with the number only."})
    return problems


def gsm8k_problems(n: int) -> list:
    rows = [r for _, r in read_jsonl(DATA / "gsm8k_test.jsonl")][:n]
    return [{"id": f"gsm8k #{i}", "level": "gsm8k",
             "prompt": r["question"] + "\nSolve it step by step and end with 'The answer is N.'",
             "answer": r["answer"].split("####")[-1].strip().replace(",", "")} for i, r in enumerate(rows)]


def last_number_correct(text: str, answer: str) -> bool:
    """The last number in the response against the reference (GSM8K's rule, and arithmetic's)."""
    numbers = re.findall(r"-?\d[\d,]*\.?\d*", text)
    if not numbers:
        return False
    try:
        return abs(float(numbers[-1].replace(",", "").rstrip(".")) - float(answer)) < 1e-6
    except ValueError:
        return False


def humaneval_problems(n: int) -> list:
    with gzip.open(DATA / "HumanEval.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f][:n]
    ask = "Complete this Python function. Reply with the whole function in a ```python block.\n\n"
    return [{"id": r["task_id"], "level": "humaneval", "prompt": ask + f"```python\n{r['prompt']}```",
             "code": r["prompt"], "test": r["test"], "entry_point": r["entry_point"]} for r in rows]


def humaneval_passes(problem: dict, response: str, timeout: float = 10.0) -> bool:
    """Run the answer against the problem's tests in the sandbox (sandbox.py: no network, no writes
    outside its own directory, limited memory, processes and time)."""
    blocks = re.findall(r"```(?:python)?\n(.*?)(?:```|$)", response, re.S)
    code = blocks[0] if blocks else response
    if f"def {problem['entry_point']}" not in code:  # a body only: complete the given signature
        code = problem["code"] + code
    else:  # keep the prompt's imports and helpers in front of the whole function
        code = problem["code"].split(f"def {problem['entry_point']}")[0] + code
    program = f"{code}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"
    return run_untrusted(program, timeout=timeout).returncode == 0


def load_problems(tasks: list, n: int, seed: int) -> list:
    problems = []
    for task in tasks:
        problems += {"arithmetic": lambda: arithmetic_problems(n, seed), "gsm8k": lambda: gsm8k_problems(n),
                     "humaneval": lambda: humaneval_problems(n)}[task]()
    return problems


def correct(problem: dict, text: str) -> bool:
    if problem["level"] == "humaneval":
        return humaneval_passes(problem, text)
    return last_number_correct(text, problem["answer"])
