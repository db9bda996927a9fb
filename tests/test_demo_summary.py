"""scripts/demo_summary.py: the demo's dense-against-sparse summary on a tiny model and its packed
16:32 copy: KL and top-1 against a float64 forward of both models, bytes per step as the CPU path
reads them, the report's lines, and bad input."""
import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from checkpoint import save_checkpoint
from model import ModelArgs, Transformer
from scripts import demo_summary
from tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parent.parent
CONFIG = dict(block_size=96, vocab_size=48, n_layer=2, n_head=4, n_local_heads=2, dim=64, intermediate_size=64)


def forward(model, ids):
    """Logits [T, vocab] of one uncached forward over ids."""
    model.setup_caches(1, len(ids))
    return model(torch.tensor([ids]), torch.arange(len(ids)))[0]


@pytest.fixture
def dense_and_sparse(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from sparse import swap_to_sparse

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(CONFIG["vocab_size"] - 3)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    torch.manual_seed(0)
    dense = Transformer(ModelArgs(**CONFIG)).eval()
    save_checkpoint(tmp_path / "model.pth", dense.state_dict(), dense.config)
    sparse = swap_to_sparse(copy.deepcopy(dense), "16:32")
    save_checkpoint(tmp_path / "pruned.pth", sparse.state_dict(), sparse.config,
                    {"sparsity": {"pattern": "16:32", "format": "bitmask-v2"}})
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w1 w2 w3\nw7 w8\n")
    return tmp_path / "model.pth", tmp_path / "pruned.pth", prompts, dense, sparse


def test_summary_against_float64_forwards(dense_and_sparse, capsys):
    dense_path, sparse_path, prompts, dense, sparse = dense_and_sparse
    summary = demo_summary.main(["--dense", str(dense_path), "--sparse", str(sparse_path), "--prompts", str(prompts),
                                 "--max_new_tokens", "8", "--sample_tokens", "6", "--device", "cpu"])
    # The reference: each prompt's dense greedy continuation, then both models teacher-forced in float64.
    tokenizer = load_tokenizer(dense_path.parent)
    dense, sparse = dense.double(), sparse.double()
    kl, agree = [], []
    with torch.no_grad():
        for text in ("w1 w2 w3", "w7 w8"):
            ids = tokenizer.encode(text, bos=True)
            for _ in range(8):
                ids.append(int(forward(dense, ids)[-1].argmax()))
            p = F.log_softmax(forward(dense, ids)[-9:-1], -1)
            q = F.log_softmax(forward(sparse, ids)[-9:-1], -1)
            kl.append((p.exp() * (p - q)).sum(-1))
            agree.append(p.argmax(-1) == q.argmax(-1))
    assert summary["fidelity"]["kl"] == pytest.approx(float(torch.cat(kl).mean()), rel=1e-3, abs=1e-6)
    assert summary["fidelity"]["top1_agreement"] == pytest.approx(float(torch.cat(agree).double().mean()))
    assert summary["fidelity"]["kl"] > 0  # half the weights are gone
    # On the CPU the sparse layers run expanded to dense: a step reads what the dense model's does.
    assert summary["sparse"]["expanded"] and summary["sparse"]["bytes_per_step"] == summary["dense"]["bytes_per_step"]
    report = capsys.readouterr().out
    for phrase in ("dense vs sparse 16:32 on cpu", "decode tok/s", "weight MB read per step", "expanded to dense",
                   "KL(dense || sparse)", "top-1 agreement", "dense:  ", "sparse: "):
        assert phrase in report


def test_missing_checkpoint_is_one_line_and_exit_code_2(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "demo_summary.py"), "--dense",
                           str(tmp_path / "nope.pth"), "--sparse", str(tmp_path / "nope.pth")],
                          capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"demo_summary: error: checkpoint not found: {tmp_path / 'nope.pth'}"]
