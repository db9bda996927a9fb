"""Quality evaluation: perplexity, decode fidelity, the paper's diagnostics, task harnesses, comparison.

Each module does one job and runs as `python -m evaluation.<name> --help`.
"""
