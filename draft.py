"""
Drafts: cheap proposers of the next k tokens. Every draft speaks the same three-call interface that
decode.py's loop drives:

    draft.start(prompt_ids)        sees the prompt (prefills its own cache, if it has one)
    draft.propose(k) -> (tokens (k,), q (k, V) or None)
                                   k guesses continuing the committed sequence, with the
                                   distributions they were drawn from (None: deterministic)
    draft.commit(new_ids, n_accepted)
                                   the verifier kept n_accepted drafted tokens and appended one
                                   more; new_ids are all of them. A draft with a cache rewinds it
                                   to the part that is still valid.

This file holds prompt lookup (n-gram matching, training-free) and an independent draft model
(any model.py checkpoint sharing the target's tokenizer).
"""
import torch

from verify import probs_from_logits


class LookupDraft:
    """Prompt lookup decoding: find the most recent earlier occurrence of the last n tokens
    (n from max_ngram down to min_ngram) and propose the tokens that followed it."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.seq: list = []
        self.forwards = 0  # no network: lookups are not forwards

    def start(self, prompt_ids):
        self.seq = list(prompt_ids)

    def propose(self, k: int):
        seq = self.seq
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            tail = seq[-n:]
            for start in range(len(seq) - n - 1, -1, -1):  # most recent match first
                if seq[start:start + n] == tail:
                    follow = seq[start + n:start + n + k]
                    if follow:
                        return torch.tensor(follow), None
        return torch.tensor([], dtype=torch.long), None

    def commit(self, new_ids, n_accepted):
        self.seq += list(new_ids)


class ModelDraft:
    """A smaller model of the same family (e.g. qwen3-0.6b for qwen3-4b) drafting autoregressively.
    Its cache holds `cache_len` committed tokens; each propose first feeds the committed tokens it
    has not seen (one, or two after a fully accepted block) and then drafts k tokens."""

    def __init__(self, model, temperature: float = 0.0, top_p: float = 1.0, generator=None):
        self.model, self.temperature, self.top_p, self.generator = model, temperature, top_p, generator
        self.device = model.lm_head.weight.device if hasattr(model.lm_head, "weight") else "cpu"
        self.seq: list = []
        self.cache_len = 0
        self.drafted = 0
        self.forwards = 0

    def start(self, prompt_ids):
        self.seq = list(prompt_ids)
        self.cache_len = self.drafted = 0

    @torch.no_grad()
    def propose(self, k: int):
        pending = self.seq[self.cache_len:]  # committed, not yet in the draft's cache
        tokens, dists = [], []
        x = torch.tensor([pending], device=self.device)
        pos = torch.arange(self.cache_len, len(self.seq), device=self.device)
        for _ in range(k):
            logits = self.model(x, pos, last_logits_only=True)[0, -1]  # (V,)
            self.forwards += 1
            q = probs_from_logits(logits, self.temperature, self.top_p)
            token = torch.multinomial(q, 1, generator=self.generator) if self.temperature > 0 else q.argmax(-1, keepdim=True)
            tokens.append(token)
            dists.append(q)
            x, pos = token.view(1, 1), pos[-1:] + 1
        # the cache now holds the committed sequence plus all drafted tokens but the last
        self.cache_len = len(self.seq)
        self.drafted = len(tokens)
        if not tokens:
            return torch.tensor([], dtype=torch.long), None
        return torch.cat(tokens), torch.stack(dists)  # (k,), (k, V)

    def commit(self, new_ids, n_accepted):
        # drafted tokens 0..drafted-2 went through the cache; keep the accepted ones among them
        self.cache_len += min(n_accepted, max(self.drafted - 1, 0))
        self.seq += list(new_ids)
