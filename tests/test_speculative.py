"""speculative.py: the loop. Plain decoding is a recomputing argmax loop's tokens; a draft, right or
wrong, changes the forwards and never the tokens at T = 0; a stop token inside a kept block ends
the answer there; the counts behind tau are what the steps did; requests the cache cannot hold are
refused in one line. (Every draft and verifier against the target's distribution:
tests/test_emits.py; trees: tests/test_tree.py.)"""
import pytest
import torch

from draft import AdaptiveDraft, Draft, HybridDraft, LookupDraft, no_tokens
from speculative import adaptive, check_request, exact_verifier, generate
from verify import Verifier

PROMPT = [4, 9, 7, 11, 5, 14, 2, 6]


def recomputed_greedy(target, prompt: list, n: int) -> list:
    """Greedy decoding the slow way: every token from a full forward of the whole sequence."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits, _ = target(torch.tensor([seq]), torch.arange(len(seq)))
            seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt):]


class ScriptedDraft(Draft):
    """Proposes what `oracle(committed sequence)` says: the plain answer's next tokens (always
    kept), wrong tokens (never kept), or nothing."""

    def __init__(self, oracle):
        self.oracle, self.seq, self.asked = oracle, [], []

    def start(self, prompt_ids, features=None):
        self.seq = list(prompt_ids)

    def propose(self, k: int):
        self.asked.append(k)
        tokens = self.oracle(self.seq)[:k]
        return (torch.tensor(tokens), None) if tokens else no_tokens()

    def commit(self, new_ids, n_accepted, features=None):
        self.seq += list(new_ids)


@pytest.fixture(scope="module")
def target(models):
    return models["target"]


def test_plain_decoding_is_the_recomputed_argmax(target):
    out = generate(target, PROMPT, max_new_tokens=12)
    assert out["tokens"] == recomputed_greedy(target, PROMPT, 12)
    assert out["target_forwards"] == 12 and out["tau"] == 1.0 and out["drafted_tokens"] == 0


@pytest.mark.parametrize("quality", ["right", "wrong", "silent"])
def test_a_draft_changes_forwards_never_tokens(target, quality):
    want = generate(target, PROMPT, max_new_tokens=12)["tokens"]

    def oracle(seq):
        ahead = want[len(seq) - len(PROMPT):]
        return {"right": ahead, "wrong": [(t + 1) % 16 for t in ahead], "silent": []}[quality]
    out = generate(target, PROMPT, ScriptedDraft(oracle), Verifier("greedy"), k=3, max_new_tokens=12)
    assert out["tokens"] == want
    if quality == "right":  # each step keeps all 3 and adds one: 12 tokens in 3 forwards
        assert out["target_forwards"] == 3 and out["tau"] == 4.0
        assert out["accepted_per_position"] == [1.0, 1.0, 1.0]
    elif quality == "wrong":
        assert out["target_forwards"] == 12 and out["drafted_tokens"] > 0
        assert out["accepted_per_position"] == [0.0, 0.0, 0.0]
    else:  # declined positions are counted apart from drafted ones
        assert out["target_forwards"] == 12 and out["drafted_tokens"] == 0 and out["declined_tokens"] > 0


def test_the_draft_is_never_asked_past_the_token_budget(target):
    draft = ScriptedDraft(lambda seq: [])
    generate(target, PROMPT, draft, Verifier("greedy"), k=5, max_new_tokens=4)
    assert draft.asked == [3, 2, 1]  # the last token is the target's own: the draft is not asked for it


def test_a_stop_token_inside_a_kept_block_ends_the_answer(target):
    want = generate(target, PROMPT, max_new_tokens=12)["tokens"]
    stop = want[5]
    cut = want[:want.index(stop) + 1]
    draft = ScriptedDraft(lambda seq: want[len(seq) - len(PROMPT):])
    out = generate(target, PROMPT, draft, Verifier("greedy"), k=4, max_new_tokens=12, stop_ids=(stop,))
    assert out["tokens"] == cut == generate(target, PROMPT, max_new_tokens=12, stop_ids=(stop,))["tokens"]


def test_on_tokens_sees_every_token_once_with_the_drafts_share(target):
    want = generate(target, PROMPT, max_new_tokens=10)["tokens"]
    seen = []
    generate(target, PROMPT, ScriptedDraft(lambda seq: want[len(seq) - len(PROMPT):]), Verifier("greedy"), k=2,
             max_new_tokens=10, on_tokens=lambda out, n: seen.append((list(out), n)))
    assert [t for out, _ in seen for t in out] == want
    assert all(n == min(2, len(out) - 1) or n == len(out) for out, n in seen)


def test_requests_the_cache_cannot_hold_are_refused(target):
    with pytest.raises(ValueError, match="empty prompt"):
        generate(target, [], max_new_tokens=4)
    with pytest.raises(ValueError, match="the context holds 64"):
        generate(target, PROMPT, max_new_tokens=60)
    with pytest.raises(ValueError, match="the greedy verifier keeps the target's argmax"):
        check_request(64, 4, 4, 0, Verifier("greedy"), 1.0)
    assert exact_verifier(0).name == "greedy" and exact_verifier(0.7).name == "lossless"


def test_adaptive_trees_need_a_draft_that_ranks_its_nodes():
    with pytest.raises(ValueError, match="adaptive trees are sized for EAGLE-3"):
        adaptive(LookupDraft(), (None, None), tree=8)
    assert isinstance(adaptive(LookupDraft(), (None, None)), AdaptiveDraft)


def test_adaptive_draft_decodes_plainly_where_no_length_pays(target):
    """A block that costs as much as its tokens could bring never pays: the adaptive draft
    proposes nothing but its probes, and the answer is plain decoding's."""
    want = generate(target, PROMPT, max_new_tokens=16)["tokens"]
    draft = ScriptedDraft(lambda seq: [(t + 1) % 16 for t in want[len(seq) - len(PROMPT):]])
    costly = adaptive(draft, (lambda n, context: 1.0 + n, None))
    out = generate(target, PROMPT, costly, Verifier("greedy"), k=4, max_new_tokens=16)
    assert out["tokens"] == want
    assert max(draft.asked) <= 1 and len(draft.asked) <= 2  # only one-token probes, after 4 and 8 plain steps


def test_an_adaptive_hybrid_drafts_lookups_that_pay_beside_a_model_that_does_not(target):
    """Lookup (free, always kept where it matches) beside a model draft that is never kept: adapted
    apart, lookup's matches are drafted whole while the model is only probed one token at a time;
    one acceptance rate for both would draft the model's wrong guesses or pause lookup's right ones."""
    want = generate(target, PROMPT, max_new_tokens=24)["tokens"]
    right = lambda seq: want[len(seq) - len(PROMPT):]
    lookup = ScriptedDraft(lambda seq: right(seq) if len(seq) % 3 else [])  # matches two steps in three
    lookup.free = True
    model = ScriptedDraft(lambda seq: [(t + 1) % 16 for t in right(seq)])
    hybrid = adaptive(HybridDraft(model, lookup), (lambda n, context: 1.0 + 0.5 * n, None))
    out = generate(target, PROMPT, hybrid, Verifier("greedy"), k=4, max_new_tokens=24)
    assert out["tokens"] == want
    assert max(model.asked, default=0) <= 1  # probes at most
    assert max(lookup.asked) == 4 and out["target_forwards"] < 16  # lookup's blocks drafted and kept
