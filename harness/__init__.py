"""
The harness: what measures. bench.py and experiments/ are its scripts (train_vat.py's --learning-curves too).

    speed.py       timed runs of decode specs, interleaved prompt by prompt, and their summaries
    stats.py       paired ratios, bootstrap intervals, power, Wilson intervals, reliability bins
    step_table.py  the decode step against the memory-bandwidth floor, and a profile of one step
    peers.py       transformers' generate and llama.cpp, timed on the same prompts
    results.py     results files: written whole, stamped with the machine, torch and commit
    learning_curves.py  finished training runs' learning curves (train_vat.py --learning-curves)
"""
