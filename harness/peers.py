"""
Peers on the same weights, timed as ours are: transformers' `generate` (plain, and its assisted
prompt lookup) on the target's directory, and llama.cpp (PyPI llama-cpp-python, optional) on the
very GGUF file the embedded default target is converted from. Each returns what our runs return,
so bench.py interleaves them with ours.
"""
import time

import torch

from engine.weights import embedded_gguf_path


def hf_peer(target_dir, kind: str, k: int):
    """transformers' generate, or its prompt-lookup assisted generation, on the same weights."""
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()

    def run(ids, max_new_tokens, temperature, stop_ids):
        x = torch.tensor([ids])
        extra = dict(prompt_lookup_num_tokens=k) if kind == "assisted" else {}
        sampling = dict(do_sample=True, temperature=temperature) if temperature > 0 else dict(do_sample=False)
        t0 = time.perf_counter()
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                          eos_token_id=sorted(stop_ids), pad_token_id=sorted(stop_ids)[0],
                          **sampling, **extra)
        return peer_result(out[0, len(ids):].tolist(), time.perf_counter() - t0)
    return run


def llama_cpp_peer(kind: str, k: int):
    """llama.cpp (PyPI llama-cpp-python, optional) on the very GGUF file the embedded default target
    is converted from: plain decoding, or its prompt-lookup speculative decoding. Sampling at T > 0
    is plain (no top-k, top-p, min-p or repetition penalty), as ours is."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    llm = Llama(model_path=str(embedded_gguf_path()), n_ctx=8192, n_threads=torch.get_num_threads(),
                draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k) if kind == "lookup" else None,
                logits_all=kind == "lookup", verbose=False)  # verification reads every drafted position

    def run(ids, max_new_tokens, temperature, stop_ids):
        t0, new, first = time.perf_counter(), [], None
        llm.reset()  # generate() reuses the cache of a prompt that shares a prefix with the last: prefill anew
        for token in llm.generate(ids, temp=temperature, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                  reset=True):
            new.append(token)
            if first is None:
                first = time.perf_counter() - t0  # the prefill and one step
            if token in stop_ids or len(new) >= max_new_tokens:
                break
        return peer_result(new, time.perf_counter() - t0, first)
    return run


def peer_result(new: list, seconds: float, first_token_seconds: float | None = None) -> dict:
    """A peer's run in the layout of ours. Its decode rate (tokens/s without the prefill) is known
    where the time to its first token is: the tokens after the first over the time after it."""
    decoding = (len(new) - 1) / max(seconds - first_token_seconds, 1e-9) \
        if first_token_seconds is not None and len(new) > 1 else None
    return {"tokens": new, "new_tokens": len(new), "seconds": seconds, "tokens_per_s": decoding, "tau": None,
            "target_forwards": None, "draft_seconds": 0.0, "accepted_per_position": [], "drafted_tokens": 0,
            "declined_tokens": 0}
