"""objectives.py: VAT's parts one by one on hand-made logits, sampled labels, and the chain
training forward against a dense reference."""
import argparse

import pytest
import torch
import torch.nn.functional as F
from conftest import eagle3_net

from engine import weights as WT
import model as M
import objectives as OB
import train_vat as TV

# -----------------------------------------------------------------------------
# The objective: VAT's parts one by one, and sampled verification labels

def hand_made_chains():
    torch.manual_seed(5)
    N, K, V = 5, 4, 9
    return torch.randn(N, K, V), torch.randn(N, K), F.log_softmax(torch.randn(N, K, V), -1), torch.rand(N, K) > 0.2


@pytest.mark.parametrize("parts", [["head"], ["weighting"], ["ce"], ["head", "weighting"], list(TV.VAT_PARTS)])
def test_each_vat_part_changes_only_its_own_term(parts):
    draft, head, tgt, valid = hand_made_chains()
    N, K = valid.shape
    settings = OB.LossSettings(frozenset(parts), "greedy", 0.5)
    loss, _ = OB.objective(draft, head, tgt, valid, settings, OB.eagle3_decay, native="soft")
    logq = F.log_softmax(draft, -1)
    soft = -(tgt.exp() * logq).sum(-1)
    hard = -logq.gather(-1, tgt.argmax(-1, keepdim=True))[..., 0]
    ce = (soft + hard if "ce" in parts else soft) * valid
    accepted = (draft.argmax(-1) == tgt.argmax(-1)) | ~valid
    kstar, labels, w_hat = OB.vat_targets(accepted, OB.eagle3_decay)
    weights = w_hat if "weighting" in parts else 0.8 ** torch.arange(K).float()
    expected = (weights * ce).sum() / N
    if "head" in parts:
        bce = F.binary_cross_entropy_with_logits(head, labels.float(), reduction="none")
        expected = expected + 0.5 * (bce * valid).sum() / valid.sum()
    assert torch.allclose(loss, expected)


def test_sampled_labels_do_not_force_rejection_outside_the_draft_vocabulary():
    # the draft's q equals the target's p on its vocabulary: min(1, p/q) = 1, every sampled token is kept;
    # the target's argmax lies outside that vocabulary, which only greedy verification cannot match
    N, K, V = 64, 3, 6
    logp = F.log_softmax(torch.randn(N, K, V), -1)
    outside = torch.zeros(N, K, dtype=torch.bool)
    valid = torch.ones(N, K, dtype=torch.bool)
    for label, sim_tau in (("sample", K + 1), ("greedy", 1)):
        settings = OB.LossSettings(frozenset(TV.VAT_PARTS), label)
        _, stats = OB.objective(logp.clone(), torch.zeros(N, K), logp, valid, settings, OB.eagle3_decay,
                                native="soft", target_in_vocab=outside)
        assert stats["sim_tau"] == pytest.approx(sim_tau), label


def test_sampled_labels_keep_a_drafted_token_as_often_as_speculative_sampling():
    """label "sample": a token drawn from q is kept with probability min(1, p/q), so a position is
    kept with probability sum_x min(p(x), q(x)), the acceptance rate of speculative sampling."""
    torch.manual_seed(0)
    n, V = 200_000, 5
    q_logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    p = torch.tensor([0.1, 0.5, 0.2, 0.15, 0.05])
    kept = OB.simulate_acceptance(q_logits.expand(n, 1, V), p.log().expand(n, 1, V), "sample")
    rate = torch.minimum(p, torch.softmax(q_logits, -1)).sum().item()  # 0.4614
    assert kept.float().mean().item() == pytest.approx(rate, abs=5 * (rate * (1 - rate) / n) ** 0.5)


def test_positions_past_the_sequence_reject_nothing():
    """A chain kept at every valid position has k* = K + 1 whatever lies past its end: the
    positions past the sequence neither count as a rejection nor restart the weights' decay."""
    N, K, V = 4, 4, 7
    logp = F.log_softmax(torch.randn(N, K, V, generator=torch.Generator().manual_seed(1)), -1)
    valid = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    settings = OB.LossSettings(frozenset(TV.VAT_PARTS), "greedy")
    _, stats = OB.objective(logp.clone(), torch.zeros(N, K), logp, valid, settings, OB.eagle3_decay,
                            native="soft")  # (the draft's argmax is the target's everywhere)
    assert stats["sim_tau"] == K + 1 and stats["kept_share"] == 1.0


def test_vat_targets_on_hand_made_rows():
    accepted = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)
    kstar, labels, w = OB.vat_targets(accepted, OB.eagle3_decay)
    assert kstar.tolist() == [3, 5, 1]
    assert labels.tolist() == [[True, True, False, False], [True] * 4, [False] * 4]
    assert torch.allclose(w, torch.tensor([[1, 1, 1, 0.8], [1, 1, 1, 1], [1, 0.8, 0.64, 0.512]]))
    _, _, wd = OB.vat_targets(accepted, OB.dflash_decay)
    assert torch.allclose(wd[2], torch.exp(-torch.arange(4.0) / 7))


def test_baseline_objective_is_the_plain_loss():
    torch.manual_seed(3)
    N, K, V = 6, 4, 11
    draft, tgt = torch.randn(N, K, V), F.log_softmax(torch.randn(N, K, V), -1)
    valid = torch.rand(N, K) > 0.2
    # the baseline objective: --vat-parts is ignored, no part of VAT applies
    baseline = TV.loss_settings(argparse.Namespace(objective="baseline", vat_label="greedy",
                                                 vat_parts=TV.VAT_PARTS, beta=1.0))
    assert baseline.parts == frozenset()
    loss, _ = OB.objective(draft, torch.zeros(N, K), tgt, valid, baseline, OB.eagle3_decay, native="soft")
    soft = -(tgt.exp() * F.log_softmax(draft, -1)).sum(-1) * valid
    assert torch.allclose(loss, (0.8 ** torch.arange(K) * soft).sum() / N)
    loss, _ = OB.objective(draft, torch.zeros(N, K), tgt, valid, baseline, OB.dflash_decay, native="hard")
    hard = F.cross_entropy(draft.flatten(0, 1), tgt.argmax(-1).flatten(), reduction="none").view(N, K) * valid
    assert torch.allclose(loss, (torch.exp(-torch.arange(K) / 7) * hard).sum() / N)


def test_vat_objective_on_hand_made_logits():
    # K = 3 positions, V = 2; the draft agrees with the target at k = 1 and 3, not at 2: k* = 2
    tgt = F.log_softmax(torch.tensor([[[2.0, 0], [2.0, 0], [2.0, 0]]]), -1)
    draft = torch.tensor([[[1.0, 0], [0, 1.0], [1.0, 0]]])
    head = torch.tensor([[3.0, -3.0, 0.0]])
    settings = OB.LossSettings(frozenset(TV.VAT_PARTS))
    loss, stats = OB.objective(draft, head, tgt, torch.ones(1, 3, dtype=torch.bool), settings, OB.eagle3_decay,
                               native="soft")
    ce = -(tgt.exp() * F.log_softmax(draft, -1)).sum(-1) - F.log_softmax(draft, -1)[..., 0]
    weights = torch.tensor([1.0, 1.0, 0.8])  # 1 before k*, then the decay restarts at k*
    bce = F.binary_cross_entropy_with_logits(head, torch.tensor([[1.0, 0, 0]]))
    assert torch.allclose(loss, (weights * ce).sum() + bce)
    assert stats["sim_tau"] == 2.0 and stats["weighting_changes"] == 1.0  # k* = 2: the weights differ
    draft[0, 0] = torch.tensor([0, 1.0])  # now rejected at k = 1: VAT's weights are the baseline's
    _, stats = OB.objective(draft, head, tgt, torch.ones(1, 3, dtype=torch.bool), settings, OB.eagle3_decay,
                            native="soft")
    assert stats["sim_tau"] == 1.0 and stats["weighting_changes"] == 0.0


# -----------------------------------------------------------------------------
# Fast training: chains that carry loss only, and the captured corpus

def ttt_mask(T: int, step: int) -> torch.Tensor:
    """EAGLE-3's training-time-test attention for every base at once, (T, (step+1)*T): the real
    prefix (step-0 keys at positions <= t) and, of steps 1..step, only the own chain's key."""
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return torch.cat([causal] + [torch.eye(T, dtype=torch.bool)] * step, dim=1)


def dense_eagle3_loss(net, target, tokens, response, settings, K):
    """The reference: EAGLE-3's training-time test unrolled over every base position of the
    padded batch with SDPA and ttt_mask (train_vat's code before it trained only the chains that
    carry loss). Its loss is a mean over all B*T chains."""
    B, T = tokens.shape
    layer = net.midlayer
    with torch.no_grad():
        target_logits, hidden = target(tokens, torch.arange(T), hidden_layers=net.target_layers)
    features = torch.cat(hidden, -1)
    cos, sin = M.rope_table(net.args, T + K)
    padded = torch.cat([tokens, tokens.new_zeros(B, K + 1)], 1)
    state, keys, values, logits, heads = net.fc(features), [], [], [], []
    for s in range(K):
        q, k, v = layer.qkv(target.embed_tokens(padded[:, 1 + s:1 + s + T]), state, cos[s:s + T], sin[s:s + T])
        keys.append(k)
        values.append(v)
        attended = layer.self_attn.attend(q, torch.cat(keys, 2), torch.cat(values, 2), ttt_mask(T, s))
        state = layer.finish(state, attended)
        step_logits, step_heads = net.heads(state)
        logits.append(step_logits)
        heads.append(step_heads)
    logits, heads = torch.stack(logits, 1), torch.stack(heads, 1)  # (B, K, T, Vd), (B, K, T)
    base, step = torch.arange(T), torch.arange(K)
    source = base[None, :] + 1 + step[:, None]  # (K, T)
    valid = (source + 1 < T)[None] & response.bool()[:, (source + 1).clamp(max=T - 1)]
    source = source.clamp(max=T - 1)
    in_vocab = net.t2d[target_logits.argmax(-1)][:, source]
    target_logp = F.log_softmax(target_logits.float(), -1)[..., net.draft_to_target()][:, source]

    def chains(x):
        return x.transpose(1, 2).flatten(0, 1)
    return OB.objective(chains(logits), chains(heads), chains(target_logp), chains(valid), settings, OB.eagle3_decay,
                        native="soft", target_in_vocab=chains(in_vocab))


def test_ttt_mask_sees_prefix_and_own_chain():
    T, s = 5, 2
    m = ttt_mask(T, s)
    assert m.shape == (T, 3 * T)
    for t in range(T):
        assert m[t, :T].tolist() == [j <= t for j in range(T)]  # the real prefix up to t
        for step in (1, 2):  # of each later step, only the same chain
            assert m[t, step * T:(step + 1) * T].tolist() == [j == t for j in range(T)]


def prompt_response_batch(vocab, lengths, starts, seed=0):
    """A right-padded batch: random tokens, the response from starts[b] to lengths[b]."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    tokens = torch.zeros(len(lengths), T, dtype=torch.long)
    mask = torch.zeros(len(lengths), T)
    for b, (n, start) in enumerate(zip(lengths, starts)):
        tokens[b, :n] = torch.randint(0, vocab, (n,), generator=g)
        mask[b, start:n] = 1
    return tokens, mask


@pytest.mark.parametrize("parts", [("weighting", "ce"), ("head", "weighting", "ce")])
def test_chain_training_equals_the_dense_reference(tiny_dir, parts):
    """Training only the chains that carry loss gives the dense reference's loss terms and
    gradients (up to its normalization: a mean over all B*T chains, padding and prompt included)."""
    target = WT.load_model(tiny_dir("qwen3_untied"))
    target.setup_caches(3, 40)
    net = eagle3_net(target).train()
    settings, K = OB.LossSettings(frozenset(parts)), 4
    tokens, mask = prompt_response_batch(96, [30, 17, 24], [9, 5, 14])
    B, T = tokens.shape
    dense, dense_stats = dense_eagle3_loss(net, target, tokens, mask, settings, K)
    dense_grads = torch.autograd.grad(dense, list(net.parameters()), allow_unused=True)
    fast, fast_stats = OB.eagle3_loss(net, target, (tokens, mask), settings, K)
    fast_grads = torch.autograd.grad(fast, list(net.parameters()), allow_unused=True)
    # the chains kept: every base t whose predictions t+2 .. t+K+1 reach a response token
    kept = sum((n - 3) - max(start - 1 - K, 0) + 1 for n, start in zip([30, 17, 24], [9, 5, 14]))
    head = fast_stats["head_loss"]
    assert head == pytest.approx(dense_stats["head_loss"], rel=1e-5)
    assert (fast.item() - head) * kept == pytest.approx((dense.item() - head) * B * T, rel=1e-5)
    for key in ("sim_tau", "head_acc", "kept_share"):
        assert fast_stats[key] == pytest.approx(dense_stats[key], rel=1e-6), key
    if "head" not in parts:  # the same objective up to the constant factor kept / (B*T)
        for (name, _), g_dense, g_fast in zip(net.named_parameters(), dense_grads, fast_grads):
            if g_dense is None:
                assert g_fast is None or not g_fast.any(), name
                continue
            scaled_fast, scaled_dense = g_fast * kept, g_dense * B * T
            assert (scaled_fast - scaled_dense).abs().max() <= 1e-5 * scaled_dense.abs().max(), name
