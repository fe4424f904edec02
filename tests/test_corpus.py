"""corpus.py: what generation captures equals a full forward, batches cover every sequence once an
epoch, and an interrupted build continues."""
import json

import torch

from data import corpus as C
from engine import weights as WT
from tokenizer import load_tokenizer

from conftest import tiny_chat_target


def corpus_recipe(tmp_path, **over):
    args = dict(target="tiny", data="prompts", num_prompts=0, self_prompts=0, response_tokens=12,
                max_prompt_tokens=32, gen_batch=4, eval_prompts=2, corpus_batches=None,
                cache_dir=str(tmp_path / "cache"))
    args.update(over)
    return C.Recipe(**args)


def test_captured_rows_equal_a_full_forward(tmp_path):
    """What generation captures for each token is what a full forward over the finished
    sequence computes: the layers' states, the final-normed state, logsumexp and argmax."""
    tiny_chat_target(tmp_path / "target")
    target = WT.load_model(tmp_path / "target")
    target.setup_caches(3, 64)
    layers = C.corpus_layers(target.args.n_layer)
    prompts = [[1, 5, 9, 40, 41], [2, 7], [3, 60, 61, 62, 70, 80, 90]]  # left padding differs per row
    responses, generated = C.batch_generate(target, prompts, 10, stop_ids={0}, capture_layers=layers)
    # responses given (the dataset's), read in one forward: the same rows as when the target wrote them
    given = [[7, 8, 9], [4], [11, 12, 13, 14, 15, 16]]
    read = C.read_responses(target, prompts, given, layers)
    target.setup_caches(1, 64)
    for was_generated, ids, response, rows in [(True, *x) for x in zip(prompts, responses, generated)] + \
            [(False, *x) for x in zip(prompts, given, read)]:
        seq = ids + response
        n = len(seq)
        assert all(len(x) == n for x in rows.values())
        logits, hidden = target(torch.tensor([seq]), torch.arange(n), hidden_layers=layers + (target.args.n_layer,))
        features = torch.cat(hidden[:-1], -1)[0, :n - 1]
        assert torch.allclose(rows["features"][:n - 1].float(), features, rtol=2e-3, atol=2e-3)
        final = target.norm(hidden[-1])[0, :n - 1]
        assert torch.allclose(rows["final"][:n - 1].float(), final, rtol=2e-3, atol=2e-3)
        assert torch.allclose(rows["lse"][:n - 1], torch.logsumexp(logits[0, :n - 1], -1), atol=1e-4)
        assert rows["argmax"][:n - 1].tolist() == logits[0, :n - 1].argmax(-1).tolist()
        if was_generated:  # greedy generation: the argmax from the prompt's last position on is the next token
            assert rows["argmax"][len(ids) - 1:n - 1].tolist() == response
        assert not rows["features"][n - 1].any()  # the last token was never read


def test_corpus_batches_cover_every_sequence_once_an_epoch_with_little_padding(tmp_path):
    import random

    class Fake:  # a corpus's layout without the target
        lengths = torch.tensor([5, 40, 7, 33, 12, 12, 90, 3, 61, 20])
        starts = lengths // 3
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        tokens = torch.arange(int(lengths.sum()))
        features = torch.zeros(int(lengths.sum()), 4, dtype=torch.float16)
        final = torch.zeros(int(lengths.sum()), 2, dtype=torch.float16)
        lse = torch.zeros(int(lengths.sum()))
        argmax = torch.zeros(int(lengths.sum()), dtype=torch.int32)
        widths = {"features": 4, "final": 2}

        @classmethod
        def rows(cls, name, lo, n):
            return getattr(cls, name)[lo:lo + n]
    stream = C.corpus_batches(Fake, range(1, 10), 100, 64, random.Random(0))
    seen, padded, real = [], 0, 0
    while len(seen) < 9:
        tokens, mask, *_ = next(stream)
        assert tokens.numel() <= 100 or len(tokens) == 1
        for row, m in zip(tokens, mask):
            i = int((Fake.offsets[:-1] == row[0]).nonzero())  # a sequence starts with its offset
            seen.append(i)
            n = min(64, int(Fake.lengths[i]))
            assert row[:n].tolist() == list(range(int(Fake.offsets[i]), int(Fake.offsets[i]) + n))
            assert m.nonzero()[:, 0].tolist() == list(range(int(Fake.starts[i]), n))
            real += n
        padded += tokens.numel()
    assert sorted(seen) == list(range(1, 10))  # each once, the held-out 0 never
    # sorted by length, a batch pads to a neighbour's length: [3 7 12 12 20] [33 40] [61] [64],
    # 252 real tokens in 305
    assert (padded, real) == (305, 252)
    # from batch `start` (a resumed run): the uninterrupted stream's batches from there, epochs of
    # 4 batches, stopped mid-epoch and past a whole one; the same for the regenerated data's batches
    whole = C.corpus_batches(Fake, range(1, 10), 100, 64, random.Random(0))
    first = [next(whole)[0].tolist() for _ in range(11)]
    for start in (2, 6):
        resumed = C.corpus_batches(Fake, range(1, 10), 100, 64, random.Random(0), start)
        assert [next(resumed)[0].tolist() for _ in range(11 - start)] == first[start:]
    data = [(list(range(n)), 1, "") for n in (3, 5, 8, 13)]
    whole = C.batches(data, 2, 16, random.Random(0))
    first = [next(whole)[0].tolist() for _ in range(6)]
    assert [next(C.batches(data, 2, 16, random.Random(0), 4))[0].tolist()] == first[4:5]


def test_an_interrupted_corpus_build_continues_where_it_stopped(tmp_path):
    tiny_chat_target(tmp_path / "target")
    target = WT.load_model(tmp_path / "target")
    target.setup_caches(4, 64)
    tokenizer = load_tokenizer(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"question {i}"}) + "\n" for i in range(9)))
    recipe = corpus_recipe(tmp_path, data=str(prompts))
    folder, n_shards = C.build_corpus(target, tokenizer, recipe)
    shards = sorted(folder.glob("shard-*.pt"))
    assert n_shards == len(shards)
    assert len(shards) == 2 + 2  # two held-out prompts alone, then 7 prompts in batches of 4
    whole = C.Corpus(folder)
    stamps = {f.name: f.stat().st_mtime_ns for f in shards}
    shards[-1].unlink()  # as if killed while writing the last one (a shard is written whole or not at all)
    C.build_corpus(target, tokenizer, recipe)
    again = C.Corpus(folder)
    assert [f.stat().st_mtime_ns for f in shards[:-1]] == [stamps[f.name] for f in shards[:-1]]
    assert again.tokens.tolist() == whole.tokens.tolist()
    for i in range(len(whole)):  # every sequence's states, read from its shard
        lo, n = int(whole.offsets[i]), int(whole.lengths[i])
        assert torch.equal(again.rows("features", lo, n), whole.rows("features", lo, n))
        assert again.rows("final", lo, n).shape == (n, target.args.dim)
    assert [again.sequence(i) for i in range(len(again))] == [whole.sequence(i) for i in range(len(whole))]
    # a prefix: the held-out prompts and the first batch, nothing generated beyond it
    assert C.build_corpus(target, tokenizer, recipe._replace(corpus_batches=1)) == (folder, 3)
    prefix = C.Corpus(folder, 3)
    assert len(prefix) == 2 + 4 and prefix.tokens.tolist() == whole.tokens[:len(prefix.tokens)].tolist()
