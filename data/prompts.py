"""
Prompts: a string, a text file, or a jsonl of Spec-Bench / ShareGPT / Alpaca / GSM8K records, each
checked to be non-empty text; a record of the wrong shape is a one-line error naming its line.
"""
import math
from pathlib import Path

from engine.files import read_jsonl, read_text


def prompt_text(record: dict) -> str:
    """The first user turn of a record in any of the formats we read; a record whose fields are
    not what its format says is a one-line error."""
    def text(value, field):
        if not isinstance(value, str):
            raise ValueError(f"its {field} is {type(value).__name__} {str(value)[:40]!r}, not text")
        return value
    if "turns" in record:  # Spec-Bench, MT-bench
        turns = record["turns"]
        if not isinstance(turns, list) or not turns:
            raise ValueError(f"its 'turns' must be a non-empty list of strings, got {str(turns)[:40]!r}")
        return text(turns[0], "first turn")
    if "conversations" in record:  # ShareGPT
        turns = record["conversations"]
        human = next((t.get("value") for t in turns if isinstance(t, dict) and t.get("from") in ("human", "user")),
                     None) if isinstance(turns, list) else None
        if human is None:
            raise ValueError("its 'conversations' hold no turn from 'human' or 'user'")
        return text(human, "first human turn")
    if "instruction" in record:  # Alpaca
        extra = record.get("input") or (record.get("instances") or [{}])[0].get("input", "")
        return text(record["instruction"], "instruction") + (f"\n\n{text(extra, 'input')}" if extra else "")
    for key in ("question", "prompt", "text"):  # GSM8K, HumanEval, plain
        if key in record:
            return record[key]
    raise ValueError(f"cannot find a prompt in a record with keys {sorted(record)}")


def prompt_file_problem(path: Path) -> str | None:
    """What keeps `path` from being read as a prompt file, said of what it is, or None."""
    if path.is_dir():
        return f"prompt file {path} is a directory: name a text or jsonl file in it"
    if not path.exists():
        return f"prompt file not found: {path}"
    if not path.is_file():
        return f"prompt file {path} is not a regular file (a device or a pipe): name a text or jsonl file"
    return None


def read_prompts(path) -> list:
    """The prompts of a text file (the whole file is one) or a jsonl (one per record)."""
    path = Path(path)
    problem = prompt_file_problem(path)
    if problem:
        raise ValueError(problem)
    if path.suffix != ".jsonl":
        prompts = [read_text(path)]
    else:
        prompts = [check_prompt(record_prompt(r, f"{path} line {n}"), f"{path} line {n}") for n, r in read_jsonl(path)]
    if not prompts or not all(p.strip() for p in prompts):
        raise ValueError(f"{path} holds no prompt" if not prompts else f"{path} is empty")
    return prompts


def record_prompt(record: dict, where: str) -> str:
    """prompt_text, its errors naming the file and line."""
    try:
        return prompt_text(record)
    except (ValueError, AttributeError, TypeError, IndexError) as e:
        raise ValueError(f"{where}: {e}") from None


def check_prompt(text, where: str) -> str:
    """A prompt must be non-empty text: None or '' would decode nothing, or the word 'None'."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{where}: the prompt is {'empty' if isinstance(text, str) else repr(text)}")
    return text


def load_prompts(path: Path, categories, limit: int | None, from_end: bool = False) -> list:
    """[(category, text)] from a Spec-Bench-like jsonl; `limit` prompts per category, the first ones
    or, from_end, the last ones (in file order either way)."""
    if not path.is_file():
        raise ValueError(f"prompt file not found: {path} (pass --prompt-file)")
    out, per_category = [], {}
    records = read_jsonl(path)
    for number, record in reversed(records) if from_end else records:
        category = record.get("category", "all")
        if categories and category not in categories or per_category.get(category, 0) >= (limit or math.inf):
            continue
        per_category[category] = per_category.get(category, 0) + 1
        out.append((category, check_prompt(record_prompt(record, f"{path} line {number}"), f"{path} line {number}")))
    if not out:
        raise ValueError(f"no prompts selected from {path}")
    return out[::-1] if from_end else out
