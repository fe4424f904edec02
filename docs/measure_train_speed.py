"""Training speed, response tokens per CPU-second on one thread: the dense training-time test of
commit e4fdf01 (with and without its --cache-features) against the chain path on the captured
corpus, on the same sequences. The old code must be checked out beside this one:

    git worktree add /tmp/oldtv e4fdf01
    python docs/measure_train_speed.py old CORPUS_DIR 4096 4 old.json   # then: new ... new.json

CORPUS_DIR is a corpus train_vat.py captured (~/.cache/vat-specdec/train/corpus-*)."""
import sys, time, random, argparse, json, glob, torch
mode, folder, vocab, steps, out_path = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
sys.path.insert(0, "/tmp/oldtv" if mode == "old" else str(__import__("pathlib").Path(__file__).resolve().parents[1]))
torch.set_num_threads(1)
import train_vat as TV, model as M
target = M.pack_for_cpu(M.load_model(M.resolve_model("smollm2-135m")))
args = argparse.Namespace(draft="eagle3", draft_vocab=vocab, objective="vat", vat_label="greedy", vat_parts=TV.VAT_PARTS,
                          beta=1.0, ttt_steps=7, target="smollm2-135m", seq_len=320, batch_size=4, cache_dir="/tmp/oldcache")
data = []  # the same 60 sequences (8..67 of the corpus) for both
for f in sorted(glob.glob(folder + "/shard-*.pt")):
    s = torch.load(f, weights_only=True)
    off = 0
    for n, st in zip(s["lengths"].tolist(), s["starts"].tolist()):
        data.append((s["tokens"][off:off + n].tolist(), st, "")); off += n
data = data[8:68]
out = {}
def run(name, stream, loss_fn):
    torch.manual_seed(0)
    net = TV.build_draft_net(args, target, data).train()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    secs = toks = 0
    for i in range(steps + 1):
        batch = next(stream)
        t0 = time.process_time()
        loss, _ = loss_fn(net, target, batch, args)
        opt.zero_grad(); loss.backward(); opt.step()
        if i:  # the first step warms up
            secs += time.process_time() - t0; toks += int(batch[1].sum())
    out[name] = {"response_tokens": toks, "cpu_seconds": secs, "response_tokens_per_s_per_thread": toks / secs}
    print(name, out[name], flush=True)
if mode == "old":
    target.setup_caches(4, 320)
    cache = TV.feature_cache(target, data, TV.eagle3_target_layers(30), args)  # built once, not timed
    target.setup_caches(4, 320)
    run("e4fdf01 dense, --cache-features (4 x 320)", TV.batches(data, 4, 320, random.Random(0), cache), TV.eagle3_loss)
    run("e4fdf01 dense, target forward each step (4 x 320)", TV.batches(data, 4, 320, random.Random(0)), TV.eagle3_loss)
else:
    corpus = TV.Corpus(__import__("pathlib").Path(folder))
    idx = list(range(8, 68))
    run("chains, captured corpus (1280 tokens a batch)", TV.corpus_batches(corpus, idx, 1280, 320, random.Random(0)), TV.eagle3_loss)
    run("chains, captured corpus (3200 tokens a batch, seq 400)", TV.corpus_batches(corpus, idx, 3200, 400, random.Random(0)), TV.eagle3_loss)
json.dump(out, open(out_path, "w"), indent=1)
