"""Tree verification: the chain rule as its one-child case (bit for bit), lossless exactness by
enumeration over children drawn without replacement, every verifier's sampler against its closed
form given the children."""
import itertools

import pytest
import torch

from verify import Verifier, induced, induced_children, verify, verify_tree

V = 5
SETTINGS = [Verifier("greedy"), Verifier("lossless"), Verifier("minp", p_base=0.3), Verifier("eta", eps=0.2),
            Verifier("cos", lam=0.3), Verifier("lenience", lenience=0.4), Verifier("overshoot", lam=0.2, ceiling=1.5)]


def dist(g, scale=2.0, size=V):
    return torch.softmax(scale * torch.randn(size, generator=g), -1)


def without(q: torch.Tensor, removed: list) -> torch.Tensor:
    """q with the tokens drawn before removed, renormalized: a child's q when sampling without replacement."""
    q = q.clone()
    q[removed] = 0
    return q / q.sum()


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled", "one-hot"])
@pytest.mark.parametrize("v", SETTINGS, ids=lambda v: v.name)
def test_one_child_tree_is_the_chain_bit_for_bit(v, deterministic):
    g = torch.Generator().manual_seed(0)
    for trial in range(150):
        k = trial % 5  # k = 0 is plain decoding: no node at all
        p = torch.stack([dist(g, 3.0) for _ in range(k + 1)])
        q = None if deterministic or k == 0 else torch.stack([dist(g, 3.0) for _ in range(k)])
        tokens = torch.multinomial(q, 1)[:, 0] if q is not None else torch.randint(V, (k,), generator=g)
        seed = 1000 + trial
        n, chain_next = verify(p[None], None if q is None else q[None], tokens[None], v,
                               torch.Generator().manual_seed(seed))
        path, tree_next = verify_tree(p, q, tokens, list(range(-1, k - 1)), v, torch.Generator().manual_seed(seed))
        assert path == list(range(int(n))) and tree_next == int(chain_next), (trial, v)


def ordered_draws(q: torch.Tensor, m: int):
    """Every ordered draw of m distinct tokens without replacement from q, with its probability
    and the q each child was drawn from."""
    for xs in itertools.permutations(range(len(q)), m):
        prob, qs = 1.0, []
        for i, x in enumerate(xs):
            q_i = without(q, list(xs[:i]))
            prob *= float(q_i[x])
            qs.append(q_i)
        yield xs, prob, qs


@pytest.mark.parametrize("m", [1, 2, 3])
def test_lossless_with_children_sampled_without_replacement_is_p(m):
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        p, q = dist(g).double(), dist(g, 1.0).double()
        q[int(torch.randint(V, (1,), generator=g))] = 0  # a token the draft never proposes
        q = q / q.sum()
        out = torch.zeros(V, dtype=torch.double)
        for xs, prob, qs in ordered_draws(q, m):
            if prob > 0:
                out += prob * induced_children(p, list(xs), qs, Verifier("lossless"))
        assert torch.allclose(out, p, atol=1e-12)


def test_lossless_with_deterministic_children_is_p_whatever_they_are():
    g = torch.Generator().manual_seed(2)
    for m in range(V + 1):
        for _ in range(5):
            p = dist(g).double()
            xs = torch.randperm(V, generator=g)[:m].tolist()
            assert torch.allclose(induced_children(p, xs, [None] * m, Verifier("lossless")), p, atol=1e-12)


@pytest.mark.parametrize("v", SETTINGS, ids=lambda v: v.name)
def test_one_sampled_child_averages_to_the_chain_closed_form(v):
    g = torch.Generator().manual_seed(3)
    p, q = dist(g).double(), dist(g, 1.0).double()
    out = sum(q[x] * induced_children(p, [x], [q], v) for x in range(V))
    assert torch.allclose(out, induced(p, q, v), atol=1e-12)


# 4 standard errors at 10,000 draws bound a token's error about as tightly as 5 at 20,000 did, in half
# the time (every draw runs verify_tree); the draws are seeded, so a pass is not luck
SAMPLES = 10_000


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled", "one-hot"])
@pytest.mark.parametrize("v", SETTINGS, ids=lambda v: v.name)
def test_sampler_matches_the_closed_form_given_the_children(v, deterministic):
    """A root with three children (leaves): the token verify_tree emits first, accepted or drawn,
    against induced_children, within 4 standard errors per token."""
    g = torch.Generator().manual_seed(4)
    p_root, q = dist(g), dist(g, 1.0)
    tokens = [int(t) for t in torch.multinomial(q, 3, replacement=False, generator=g)]
    qs = [None] * 3 if deterministic else [without(q, tokens[:i]) for i in range(3)]
    p = torch.stack([p_root] + [dist(g) for _ in range(3)])
    expected = induced_children(p_root, tokens, qs, v).double()
    counts = torch.zeros(V, dtype=torch.double)
    sampler = torch.Generator().manual_seed(5)
    q_nodes = None if deterministic else torch.stack(qs)
    samples = 1 if v.name == "greedy" else SAMPLES  # (greedy draws nothing: one run is every run)
    for _ in range(samples):
        path, nxt = verify_tree(p, q_nodes, torch.tensor(tokens), [-1, -1, -1], v, sampler)
        counts[tokens[path[0]] if path else nxt] += 1
    empirical = counts / samples
    bound = 4 * (expected * (1 - expected) / samples).sqrt() + 1e-3
    assert ((empirical - expected).abs() <= bound).all(), (empirical, expected)


def test_a_rejected_child_never_comes_out_as_the_correction():
    g = torch.Generator().manual_seed(6)
    for _ in range(200):
        p, q = dist(g), dist(g, 1.0)
        tokens = torch.multinomial(q, 2, replacement=False, generator=g)
        qs = torch.stack([q, without(q, [int(tokens[0])])])
        path, nxt = verify_tree(torch.stack([p, p, p]), qs, tokens, [-1, -1], Verifier("lossless"), g)
        if not path:
            assert nxt not in tokens.tolist()


def test_greedy_follows_the_argmax_down_the_tree():
    # root -> {a, b}; b -> {c, d}: the argmax at the root is b, at b it is d
    p = torch.full((5, V), 0.1)
    p[0, 1] = p[2, 3] = p[4, 0] = 0.6
    tokens = torch.tensor([0, 1, 2, 3])  # a=0, b=1, c=2, d=3
    path, nxt = verify_tree(p, None, tokens, [-1, -1, 1, 1], Verifier("greedy"))
    assert path == [1, 3] and nxt == 0


# -----------------------------------------------------------------------------
# The target's tree attention: each node's row is its own path's one-token step

from engine import checkpoints as CK
from engine import files as FL
from engine import layouts as LY  # noqa: E402
from speculative import generate  # noqa: E402
from draft import tree_depths  # noqa: E402
from draft import LookupDraft
from dflash import DFlashDraft
from eagle3 import Eagle3Draft
from test_emits import (FRESH, REPEATING, T, assert_fits, continuation_distribution, index_of,  # noqa: E402
                        make_draft)
from conftest import dflash_net, eagle3_net  # noqa: E402

BRANCHING = [1, 2, 3, 1, 2, 4, 1, 2]  # "1 2" was followed by 4 and by 3: a lookup tree branches at its root

# root -> 0, 1; 0 -> 2, 3; 1 -> 4; 3 -> 5: rows in topological order, siblings next to each other
PARENTS = [-1, -1, 0, 0, 1, 3]


def path_to(node: int) -> list:
    path = []
    while node >= 0:
        path.append(node)
        node = PARENTS[node]
    return path[::-1]


@pytest.mark.parametrize("layout", ["float32", "bfloat16-packed", "int8", "int4"])
def test_tree_rows_are_their_paths_one_token_steps(tiny_dir, layout):
    """Every row of a tree block against one-token steps down that row's path (bit for bit where
    the layout attends row by row, as for chains); then keep_path leaves the cache as the
    accepted path's one-token steps would."""
    m = LY.build_target(tiny_dir("qwen3_untied"), layout, "cpu", 256)
    torch.manual_seed(0)
    context = torch.randint(0, 97, (1, 200))
    nodes = torch.randint(0, 97, (len(PARENTS),))
    L = 200
    with torch.no_grad():
        m(context[:, :-1], torch.arange(L - 1))
        block, _ = m(torch.cat([context[0, -1:], nodes])[None], torch.arange(L - 1, L + len(PARENTS)),
                     tree_parents=PARENTS)
        for node in range(len(PARENTS)):
            path = path_to(node)
            x = torch.cat([context[0, -1:], nodes[path]])
            steps = [m(x[None, i:i + 1], torch.tensor([L - 1 + i]))[0] for i in range(len(x))]
            row = block[0, node + 1]
            if layout == "float32":
                assert torch.allclose(row, steps[-1][0, 0], atol=1e-5)
            else:
                assert torch.equal(row, steps[-1][0, 0]), node
            assert torch.allclose(block[0, 0], steps[0][0, 0], atol=1e-5)
        # a block down the path 1 -> 4 (rows 2, 5), then keep_path, then one more token: as if the
        # path had been decoded one token at a time
        m(torch.cat([context[0, -1:], nodes])[None], torch.arange(L - 1, L + len(PARENTS)), tree_parents=PARENTS)
        m.keep_path([L + 1, L + 4], L)
        after_tree = m(torch.tensor([[5]]), torch.tensor([L + 2]))[0]
        x = torch.cat([context[0, -1:], nodes[[1, 4]], torch.tensor([5])])
        chain = [m(x[None, i:i + 1], torch.tensor([L - 1 + i]))[0] for i in range(4)][-1]
    assert torch.allclose(after_tree, chain, atol=1e-5) if layout == "float32" else torch.equal(after_tree, chain)


def test_tree_depths():
    assert tree_depths(PARENTS) == [1, 1, 2, 2, 2, 3]


# -----------------------------------------------------------------------------
# What tree decoding emits: plain greedy decoding at T = 0, the target's distribution at T > 0

def tree_draft(kind: str, models, target, temperature=0.0, generator=None):
    """The draft of each kind trees are drafted with, as test_emits builds it (lookup, EAGLE-3 with
    and without early exit by either signal, the hybrid)."""
    return make_draft(kind, models, target, temperature, 1.0, generator)


@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
@pytest.mark.parametrize("kind", ["lookup", "eagle3", "eagle3 early exit", "eagle3 confidence exit", "hybrid"])
def test_greedy_tree_decoding_is_plain_greedy_decoding(models, kind, int8):
    target = models["int8" if int8 else "target"]
    drafted = declined = 0
    for prompt in (REPEATING, FRESH):
        plain = generate(target, prompt, max_new_tokens=16)["tokens"]
        for budget in (4, 10):
            out = generate(target, prompt, tree_draft(kind, models, target), Verifier("greedy"), k=3,
                           max_new_tokens=16, tree=budget)
            assert out["tokens"] == plain, (kind, prompt, budget)
            drafted, declined = drafted + out["drafted_tokens"], declined + out["declined_tokens"]
    assert drafted > 0 and (declined > 0 if "early exit" in kind else True)


@pytest.mark.parametrize("signal", ["head", "confidence"])
def test_a_trees_early_exit_prunes_the_nodes_its_signal_rejects(models, signal):
    """In a tree, early exit drops the children of a node whose signal falls below the threshold:
    at 0 the tree of no early exit, at a threshold no signal reaches no tree at all; the tokens
    are plain decoding's either way."""
    target = models["target"]
    net = eagle3_net(target, draft_vocab=12)
    runs = {threshold: generate(target, FRESH, Eagle3Draft(net, target.embed_tokens, target.max_seq_len,
                                                           early_exit=threshold, exit_signal=signal),
                                Verifier("greedy"), k=3, max_new_tokens=12, tree=8)
            for threshold in (None, 0.0, 1.01)}
    plain = generate(target, FRESH, max_new_tokens=12)["tokens"]
    assert all(run["tokens"] == plain for run in runs.values())
    assert runs[0.0]["drafted_tokens"] == runs[None]["drafted_tokens"] > 0
    assert runs[1.01]["drafted_tokens"] == 0


@pytest.mark.parametrize("kind", ["eagle3", "eagle3 early exit"])
def test_adaptive_tree_decoding_is_plain_greedy_decoding(models, kind):
    """Trees sized by cost keep a best-first prefix of the draft's tree: still a tree, still exact."""
    from draft import AdaptiveDraft
    target, sizes = models["int8"], []
    for prompt in (REPEATING, FRESH):
        plain = generate(target, prompt, max_new_tokens=16)["tokens"]
        adaptive = AdaptiveDraft(tree_draft(kind, models, target), lambda n, context: 1 + 0.1 * n)
        real_size = adaptive.tree_size
        adaptive.tree_size = lambda values, depth: sizes.append(real_size(values, depth)) or sizes[-1]
        out = generate(target, prompt, adaptive, Verifier("greedy"), k=3, max_new_tokens=16, tree=10)
        assert out["tokens"] == plain, (kind, prompt)
    assert sizes and max(sizes) > 1  # (blocks this cheap pay for more than one node)


def test_tree_size_weighs_node_values_against_what_a_block_costs():
    """The kept prefix maximizes expected tokens (1 + c * the values kept) per unit of time."""
    from draft import AdaptiveDraft, LookupDraft
    adaptive = AdaptiveDraft(LookupDraft(), lambda n, context: 1 + 0.25 * n)
    values = [0.9, 0.5, 0.3, 0.2, 0.05]
    # rate(m) = (1 + sum(values[:m])) / (1 + m / 4): 1, 1.52, 1.6, 1.54, 1.45, 1.31 for m = 0..5
    assert adaptive.tree_size(values, depth=2) == 2
    adaptive.tree_kept, adaptive.tree_valued = 0.1, 1.0  # its values promised ten times what it kept
    assert adaptive.tree_size(values, depth=2) == 0
    adaptive.tree_kept = adaptive.tree_valued = 1.0
    adaptive.draft_step = 1.0  # a slow draft: two forwards of a step each for this depth-2 tree
    assert adaptive.tree_size(values, depth=2) == 0
    adaptive.cost, adaptive.draft_step = None, 0.0  # a GPU: a block costs a step, every node pays
    assert adaptive.tree_size(values, depth=2) == 5


@pytest.mark.parametrize("kind,prompt", [("lookup", REPEATING), ("eagle3", FRESH), ("eagle3 early exit", FRESH)],
                         ids=["lookup", "eagle3", "eagle3 early exit"])
def test_lossless_tree_decoding_emits_the_target_distribution(models, kind, prompt):
    """Two new tokens, 300 runs, against the exact two-token distribution (as tests/test_emits.py
    does for chains): the first step's tree is verified with EAGLE-2's rule."""
    target, runs = models["target"], 300
    exact = continuation_distribution(target, prompt, 2, T)
    generator = torch.Generator().manual_seed(0)
    draft = tree_draft(kind, models, target, T, generator)
    counts = torch.zeros(len(exact), dtype=torch.double)
    for _ in range(runs):
        out = generate(target, prompt, draft, None, k=3, max_new_tokens=2, temperature=T, generator=generator,
                       tree=6)
        counts[index_of(out["tokens"])] += 1
    assert_fits(counts, exact, f"{kind} tree")


@pytest.mark.parametrize("v", [Verifier("minp", p_base=0.1), Verifier("overshoot", lam=0.5, ceiling=4.0),
                               Verifier("lenience", lenience=0.25)], ids=lambda v: v.name)
def test_lossy_tree_decoding_emits_its_closed_form(models, v):
    """Prompt lookup's tree is deterministic: the first token follows induced_children over the
    root's children, which the test reads from the draft itself."""
    from verify import probs_from_logits
    target, runs, prompt = models["target"], 300, BRANCHING
    lookup = LookupDraft()
    lookup.start(prompt)
    tokens, parents, _ = lookup.propose_tree(6, 3)
    root_children = [int(t) for t, parent in zip(tokens, parents) if parent == -1]
    assert len(root_children) >= 2, "the test needs a branching root"
    with torch.no_grad():
        target.setup_caches(1, 64)
        logits, _ = target(torch.tensor([prompt]), torch.arange(len(prompt)))
    p = probs_from_logits(logits[0, -1], T)
    want = induced_children(p, root_children, [None] * len(root_children), v).double()
    assert (want - p).abs().sum() > 0.05, "no power: the verifier must change the distribution here"
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(len(p), dtype=torch.double)
    for _ in range(runs):
        out = generate(target, prompt, LookupDraft(), v, k=3, max_new_tokens=2, temperature=T, generator=generator,
                       tree=6)
        counts[out["tokens"][0]] += 1
    assert_fits(counts, want, f"{v.name} tree")


# -----------------------------------------------------------------------------
# The real default target, the command line and the benchmark

@pytest.mark.slow  # (decode.py's --tree 8 and the GSM8K draft's --tree 16 hold the same in tests/test_decode.py)
def test_default_target_tree_decoding_is_its_plain_decoding(default_int4):
    """SmolLM2 in int4 (verification row by row): lookup and EAGLE-3 trees give plain decoding's tokens."""
    target, tokenizer = default_int4
    ids = tokenizer.encode_chat([{"role": "user", "content": "Repeat the following list exactly, one item per "
                                  "line: apples, bananas, cherries, dates, elderberries, figs, grapes."}])
    plain = generate(target, ids, max_new_tokens=48, stop_ids=tokenizer.stop_ids)
    tree = generate(target, ids, LookupDraft(), Verifier("greedy"), k=7, max_new_tokens=48,
                    stop_ids=tokenizer.stop_ids, tree=16)
    assert tree["tokens"] == plain["tokens"] and tree["target_forwards"] < plain["target_forwards"]
    # and the committed GSM8K EAGLE-3 draft's dynamic trees, with early exit pruning branches
    draft = CK.build_draft(str(FL.ROOT / "drafts" / "smollm2-135m-eagle3-gsm8k-2ep"), target, tokenizer,
                           early_exit="auto")
    ids = tokenizer.encode_chat([{"role": "user", "content": "A baker makes 24 muffins and sells 17. How many "
                                  "muffins are left?"}])
    plain = generate(target, ids, max_new_tokens=48, stop_ids=tokenizer.stop_ids)
    tree = generate(target, ids, draft, Verifier("greedy"), k=7, max_new_tokens=48, stop_ids=tokenizer.stop_ids,
                    tree=7)
    assert tree["tokens"] == plain["tokens"] and tree["target_forwards"] < plain["target_forwards"]
    assert tree["declined_tokens"] > 0  # early exit pruned some branches


def test_cli_tree_flags(capsys):
    from decode import TokenColours, get_args
    assert get_args(["--tree", "8"]).adaptive is False  # adaptive lookup is the chain's default only
    for argv, message in ((["--tree", "-1"], "--tree takes"),
                          (["--tree", "8", "--compile", "on"], "--tree needs --compile off"),
                          (["--tree", "8", "--adaptive", "--temperature", "1"], "temperature 0 only")):
        with pytest.raises(SystemExit):
            get_args(argv)
        assert message in capsys.readouterr().err
    show = TokenColours(True)
    assert show.paint("the", 0) == "the" and show.paint("the", 2) == "\x1b[36mthe\x1b[0m"
    assert TokenColours(False).paint("the", 2) == "the"


def test_bench_tree_specs():
    import bench
    from harness import speed
    assert speed.parse_spec("lookup@tree16") == ("lookup", None, 16, False, "head")
    assert speed.parse_spec("drafts/x@ee0.2@tree8") == ("drafts/x", 0.2, 8, False, "head")
    assert speed.parse_spec("drafts/x@tree8@ee0.2") == ("drafts/x", 0.2, 8, False, "head")  # in any order
    assert speed.parse_spec("drafts/x@adapt@ee") == ("drafts/x", "auto", 0, True, "head")
    assert speed.draft_label("drafts/x@ee@tree8") == "x +early-exit tree8"
    assert speed.parse_spec("drafts/x@tree8@adapt") == ("drafts/x", None, 8, True, "head")  # sized by cost
    assert speed.parse_spec("drafts/x@conf@ee0.4") == ("drafts/x", 0.4, 0, False, "confidence")
    assert speed.draft_label("drafts/x@ee0.4@conf") == "x +early-exit by confidence 0.4"
    for spec in ("lookup@ee", "drafts/x@ee5", "drafts/x@eeabc", "drafts/x@conf", "drafts/x@ee@conf1",
                 "lookup@tree0", "lookup@adapt@adapt", "lookup@fast"):
        with pytest.raises(SystemExit):
            bench.get_args(["--drafts", spec])
    with pytest.raises(SystemExit):
        bench.get_args(["--drafts", "lookup", "--paired", "lookup,lookup"])


# -----------------------------------------------------------------------------
# The verification head's record (bench's reliability data), chains only

@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_head_calibration_pairs_each_drafted_token_with_its_fate(models, kind):
    """bench.py's watch on a draft's head: one (probability, kept) pair per drafted token, and the
    watched draft decodes what the draft alone decodes."""
    from bench import HeadCalibration
    from harness.stats import reliability
    target = models["target"]
    def fresh():
        if kind == "dflash":
            return DFlashDraft(dflash_net(target, block=4), target.embed_tokens, target.lm_head, target.max_seq_len)
        return tree_draft(kind, models, target)
    alone = generate(target, FRESH, fresh(), Verifier("greedy"), k=3, max_new_tokens=16)
    draft = HeadCalibration(fresh())
    out = generate(target, FRESH, draft, Verifier("greedy"), k=3, max_new_tokens=16)
    assert out["tokens"] == alone["tokens"] and out["drafted_tokens"] == alone["drafted_tokens"]
    kept = out["new_tokens"] - out["target_forwards"]  # (no stop token here: every step adds one of its own)
    assert len(draft.pairs) == out["drafted_tokens"] and sum(k for _, k in draft.pairs) == kept
    assert all(0 <= p <= 1 for p, _ in draft.pairs)
    r = reliability([(0.05, False), (0.15, True), (0.95, True), (1.0, True)], bins=10)
    assert r["tokens"] == 4 and r["kept_share"] == 0.75 and [b["tokens"] for b in r["bins"]] == [1, 1, 2]
    assert r["brier"] == pytest.approx((0.05 ** 2 + 0.85 ** 2 + 0.05 ** 2 + 0) / 4)
