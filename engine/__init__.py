"""
The engine: what finds, loads and saves weights and runs them fast on a CPU. The reference at the
top level (model.py, the drafts, verify.py, the loop, the objectives) imports nothing from here; the
scripts hand it what the engine prepared.

    weights.py       names, local directories, the Hugging Face cache, the embedded GGUF's conversion
    checkpoints.py   draft folders: build, load, export, save atomically
    training_runs.py a training run's checkpoints and log: written whole, the newest that loads resumes
    files.py         paths of the repository, atomic writes, JSON and JSONL reading with one-line errors
    linear_forms.py  the CPU forms of a Linear (oneDNN-packed, int8, int4) and the swaps into them
    layouts.py       which form a run's target takes (--dtype auto: timed once per CPU)
    timing_cache.py  the layout timings a machine keeps, and the rules a kept timing must meet
    rows_apart.py    the attention swapped in where blocks must give one-token steps' bits
    compiled.py      the target's step and verification block compiled (torch.compile), blocks exact
    graph_cache.py   compiled graphs kept on disk beside the layouts, so a second run loads them
    machine.py       device, threads, memory figures, the options every script shares, how a script ends
"""
