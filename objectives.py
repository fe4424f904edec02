"""
The training objectives of EAGLE-3 and DFlash drafts, plain and verification-aware (VAT).

Plain: EAGLE-3 unrolls K draft steps (the training-time test) and learns the target's distribution
on the draft vocabulary with weights 0.8^(k-1); DFlash fills blocks at random anchors with hard
cross-entropy weighted exp(-(k-1)/7).

VAT simulates verification at every step: m_k = 1 if the target keeps the drafted token at
position k; k* is the first k with m_k = 0 (K+1 if none). The verification head learns
v_k = 1[k < k*] (BCE), and the loss weights restart their decay at k*: w_hat_k = 1 for k < k*,
w_(k-k*+1) after. L = sum_k w_hat_k (soft CE + hard CE) + beta L_VH. Each part can be switched on
alone (LossSettings.parts: the paper's ablation rows).

The target's side of a batch comes from a captured corpus (data/corpus.py: its features at its
own list of layers, handed in as captured_layers) or from a target forward; the drafts' own
forwards are eagle3.py's and dflash.py's.
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F

from dflash import DFlash, dflash_blocks
from eagle3 import Eagle3, eagle3_chains

# -----------------------------------------------------------------------------
# VAT: simulated verification, first rejection, head labels, adaptive weights

def eagle3_decay(j):
    return 0.8 ** (j - 1)


def dflash_decay(j):
    return torch.exp(-(j - 1) / 7.0)


def vat_targets(accepted: torch.Tensor, decay):
    """accepted (N, K) bool: m_k for each chain. Returns k* (N,) in 1..K+1, head labels v (N, K)
    and the adaptive weights w_hat (N, K): 1 before k*, the decay restarted at k* after it."""
    N, K = accepted.shape
    k = torch.arange(1, K + 1, device=accepted.device).expand(N, K)
    kstar = accepted.long().cumprod(-1).sum(-1) + 1  # (N,)
    labels = k < kstar[:, None]
    restarted = decay((k - kstar[:, None] + 1).float())  # the decay, restarted at k*
    w = torch.where(labels, torch.ones_like(k, dtype=torch.float), restarted)
    return kstar, labels, w


def plain_weights(N, K, decay, device=None):
    return decay(torch.arange(1, K + 1, device=device).float()).expand(N, K)


def step_losses(draft_logits, target_logits, valid, soft: bool, hard: bool):
    """Per-position soft CE (against the target's distribution) and/or hard CE (against its
    argmax), (...,) each; positions that are not valid contribute 0."""
    logp = F.log_softmax(draft_logits.float(), -1)
    loss = torch.zeros(draft_logits.shape[:-1], device=draft_logits.device)
    if soft:
        loss = loss - (F.softmax(target_logits.float(), -1) * logp).sum(-1)
    if hard:
        loss = loss - logp.gather(-1, target_logits.argmax(-1, keepdim=True))[..., 0]
    return loss * valid


def simulate_acceptance(draft_logits, target_logp, label: str):
    """m_k: does the target keep the draft's token? greedy: the argmaxes agree; sample: a token
    drawn from q is kept with probability min(1, p/q). target_logp are the target's log-probs on
    the draft's vocabulary (not renormalized there, so p(x) is the target's true probability)."""
    if label == "greedy":
        return draft_logits.argmax(-1) == target_logp.argmax(-1)
    q, p = F.softmax(draft_logits.float(), -1), target_logp.float().exp()
    x = torch.multinomial(q.reshape(-1, q.shape[-1]), 1).view(q.shape[:-1] + (1,))
    ratio = (p.gather(-1, x) / q.gather(-1, x).clamp_min(1e-12))[..., 0]
    return torch.rand_like(ratio) < ratio.clamp(max=1)


class LossSettings(NamedTuple):
    """What the draft's loss trains: VAT's parts (none: the draft's own objective), the
    verification its labels and k* simulate, and the head's weight in the sum."""
    parts: frozenset = frozenset()
    label: str = "greedy"
    beta: float = 1.0


def objective(draft_logits, head_logits, target_logp, valid, settings: LossSettings, decay,
              native: str, target_in_vocab=None):
    """The loss of one batch of K-step chains. draft_logits and target_logp (N, K, V') on the same
    vocabulary, head_logits (N, K), valid (N, K). native: 'soft' (EAGLE-3) or 'hard' (DFlash).
    target_in_vocab (N, K): whether the target's argmax is in the draft vocabulary at all."""
    N, K = valid.shape
    valid = valid.bool()
    with torch.no_grad():
        accepted = simulate_acceptance(draft_logits, target_logp, settings.label)
        if target_in_vocab is not None and settings.label == "greedy":
            # greedy verification keeps only the target's argmax, which a draft cannot propose when
            # its vocabulary lacks it; sampled verification can still keep another drafted token
            accepted &= target_in_vocab
        # past the sequence: no rejection
        kstar, labels, w_hat = vat_targets(accepted | ~valid, decay)
    valid_f = valid.float()
    ce_valid = valid_f if target_in_vocab is None else valid_f * target_in_vocab
    # VAT changes three things; --vat-parts picks them for the paper's ablation rows
    parts = settings.parts
    both_ce = "ce" in parts  # soft + hard CE for either draft, instead of the draft's native one
    ce = step_losses(draft_logits, target_logp, ce_valid, soft=both_ce or native == "soft",
                     hard=both_ce or native == "hard")
    weights = w_hat if "weighting" in parts else plain_weights(N, K, decay, valid.device)
    loss = (weights * ce).sum() / N
    head_loss = torch.zeros(())
    if "head" in parts:
        head = F.binary_cross_entropy_with_logits(head_logits.float(), labels.float(),
                                                  reduction="none")
        head_loss = (head * valid_f).sum() / valid_f.sum().clamp_min(1)
        loss = loss + settings.beta * head_loss
    chains = valid[:, 0].bool()  # chains that start inside the response
    n_valid = valid_f.sum().clamp_min(1).item()
    started = kstar[chains].float()
    stats = {"loss": loss.item(), "head_loss": head_loss.item(),
             "sim_tau": started.mean().item() if chains.any() else 1.0,  # k*-1 kept + bonus
             # the chains whose loss weights VAT's weighting changes: k* = 1 restarts the decay
             # where it starts anyway
             "weighting_changes": (started > 1).float().mean().item() if chains.any() else 0.0,
             "head_acc": (((head_logits > 0) == labels).float() * valid_f).sum().item() / n_valid,
             # the share of positions labelled "kept": a constant head scores max(this, 1 - this)
             "kept_share": (labels.float() * valid_f).sum().item() / n_valid}
    return loss, stats


def target_pass(target, batch, layers, captured_layers: tuple):
    """The frozen target on a batch: its logits (B, T, V) and the features the draft reads
    (B, T, len(layers) * dim). From a corpus the batch carries the features (of captured_layers)
    and the final-normed states, from which the logits are one matmul away."""
    tokens, _, *captured = batch
    with torch.no_grad():
        if captured:
            features, final = captured[0], captured[1].to(target.norm.weight.dtype)
            features = captured_features(features, layers, captured_layers, target)
            return target.lm_head(final), features
        logits, hidden = target(tokens, torch.arange(tokens.shape[1], device=tokens.device),
                                hidden_layers=layers)
        return logits, torch.cat(hidden, -1)


def captured_features(features, layers, have: tuple, target):
    """The draft's layers out of a corpus's features (B, T, len(have) * dim) of layers `have`, in
    the draft's order."""
    dim = target.args.dim
    features = features.to(target.norm.weight.dtype)
    slices = [features[..., have.index(i) * dim:(have.index(i) + 1) * dim] for i in layers]
    return torch.cat(slices, -1)


def eagle3_target_side(net: Eagle3, target, batch, head_weight, captured_layers: tuple):
    """(features (B, T, 3*dim_t), the target's log-probs on the draft vocabulary (B, T, Vd), its
    top token (B, T)): from a corpus without the target, else from a target forward."""
    tokens, _, *captured = batch
    with torch.no_grad():
        if not captured:
            logits, features = target_pass(target, batch, net.target_layers, captured_layers)
            logp = F.log_softmax(logits.float(), -1)[..., net.draft_to_target()]
            return features, logp, logits.argmax(-1)
        features, final, lse, top = captured
        rows = head_weight[net.draft_to_target()].float()  # (Vd, dim)
        logp = F.linear(final.float(), rows) - lse[..., None]  # (B, T, Vd), normalized over all V
        features = captured_features(features, net.target_layers, captured_layers, target)
        return features, logp, top.long()


def eagle3_loss(net: Eagle3, target, batch, settings: LossSettings, K: int, head_weight=None,
                captured_layers: tuple = (), chains=eagle3_chains):
    """EAGLE-3's training-time test on one batch, as K-step chains from the base positions whose
    chain predicts at least one response token; the loss is a mean over those chains. head_weight
    and captured_layers: as DraftLoss takes them; chains: eagle3_chains, or it compiled."""
    head_weight = target.lm_head.weight if head_weight is None else head_weight
    tokens, response = batch[0], batch[1].bool()
    T = tokens.shape[1]
    features, target_logp, target_top = eagle3_target_side(net, target, batch, head_weight,
                                                           captured_layers)
    # the chain from base t predicts, at step s, the token at t+2+s; the target's distribution
    # for it sits at t+1+s
    step = torch.arange(K, device=tokens.device)
    predicted = torch.arange(T, device=tokens.device)[:, None] + 2 + step  # (T, K)
    valid = (predicted < T) & response[:, predicted.clamp(max=T - 1)]  # (B, T, K)
    b, t = valid.any(-1).nonzero(as_tuple=True)  # (N,) each: the chains that carry loss
    # (N, K, Vd), (N, K)
    logits, heads = chains(net, target.embed_tokens, tokens, features, b, t, K)
    source = (t[:, None] + 1 + step).clamp(max=T - 1)  # (N, K)
    return objective(logits, heads, target_logp[b[:, None], source], valid[b, t], settings,
                     eagle3_decay, native="soft",
                     target_in_vocab=net.t2d[target_top[b[:, None], source]])


def dflash_loss(net: DFlash, target, batch, settings: LossSettings, blocks_per_seq: int,
                head_weight=None, captured_layers: tuple = ()):
    """DFlash's block objective on one batch: blocks_per_seq blocks at random anchors inside each
    response. head_weight and captured_layers: as DraftLoss takes them."""
    head_weight = target.lm_head.weight if head_weight is None else head_weight
    tokens, response = batch[0], batch[1].bool()
    B, T = tokens.shape
    bs = net.block_size
    target_logits, features = target_pass(target, batch, net.target_layers, captured_layers)
    anchors = sample_anchors(response, blocks_per_seq)  # (B, nb)
    # the target's lm_head as a plain matmul (head_weight): the draft's gradient flows through it
    logits, heads = dflash_blocks(net, target.embed_tokens, lambda x: F.linear(x, head_weight),
                                  tokens, features, anchors)
    # (B, nb, bs-1): the positions predicted
    pos = anchors[..., None] + torch.arange(1, bs, device=tokens.device)
    pos_inside = pos.clamp(max=T - 1)
    # the target's distribution for the token at pos comes from position pos - 1
    rows = (pos_inside - 1).view(B, -1, 1).expand(-1, -1, target_logits.shape[-1])
    target_logits = target_logits.gather(1, rows).view(*pos.shape, -1)  # (B, nb, bs-1, V)
    target_logp = F.log_softmax(target_logits.float(), -1)
    valid = (pos < T) & response.gather(1, pos_inside.view(B, -1)).view(pos.shape)

    def blocks(x):  # (B, nb, bs-1, ...) -> (B*nb, bs-1, ...): one chain per block
        return x.flatten(0, 1)
    return objective(blocks(logits), blocks(heads), blocks(target_logp), blocks(valid), settings,
                     dflash_decay, native="hard")


def sample_anchors(response, n: int):
    """n random anchors per sequence, each the position just before a response token."""
    B, T = response.shape
    out = torch.zeros(B, n, dtype=torch.long, device=response.device)
    for b in range(B):
        starts = (response[b, 1:].nonzero()[:, 0])  # anchor a predicts a+1.. : a+1 must be response
        if len(starts) == 0:
            continue
        out[b] = starts[torch.randint(len(starts), (n,))]
    return out


# -----------------------------------------------------------------------------
# Both drafts' losses as one module, so DDP sees the forward it must sync

class DraftLoss(torch.nn.Module):
    """The draft and its training loss as one module, so DDP sees the forward it must sync.
    The target is held outside the module's parameters: frozen, and never all-reduced.
    head_weight: the target's output head as a plain (V, dim) tensor, default its lm_head's weight
    (a CPU engine's packed or quantized head has no autograd: the caller hands a dense copy).
    captured_layers: the target layers a captured corpus's features hold, in order (batches
    from a corpus carry them; on-the-fly batches do not). compiled: EAGLE-3's training-time test
    runs as one graph (torch.compile, dynamic shapes: batches differ in length and in how many
    chains carry loss), which trains the same numbers to rounding (docs/train-compile); the loss's
    statistics read values to the host and stay eager, as does DFlash's block forward."""

    def __init__(self, net, target, settings: LossSettings, ttt_steps: int, blocks_per_seq: int,
                 head_weight: torch.Tensor | None = None, captured_layers: tuple = (),
                 compiled: bool = False):
        super().__init__()
        self.chains = torch.compile(eagle3_chains, dynamic=True) if compiled else eagle3_chains
        # (a tuple: a module attribute would make the target's tensors parameters of this module)
        self.frozen = (target, target.lm_head.weight if head_weight is None else head_weight)
        self.net, self.settings, self.captured_layers = net, settings, tuple(captured_layers)
        self.ttt_steps, self.blocks_per_seq = ttt_steps, blocks_per_seq

    def forward(self, *batch):
        target, head_weight = self.frozen
        if isinstance(self.net, Eagle3):
            return eagle3_loss(self.net, target, batch, self.settings, self.ttt_steps, head_weight,
                               self.captured_layers, self.chains)
        return dflash_loss(self.net, target, batch, self.settings, self.blocks_per_seq, head_weight,
                           self.captured_layers)
