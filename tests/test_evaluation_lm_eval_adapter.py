"""evaluation/lm_eval_adapter.py against lm-eval's own Hugging Face model (`hf`) on the exported folder
of the same checkpoint: the local tasks in tests/data/lm_eval_tasks (multiple choice, generate_until,
loglikelihood_rolling) give the same scores and per-request log-likelihoods within 1e-3."""

import dataclasses

import pytest
import torch

from checkpoint import load_checkpoint
from conftest import REPO
from convert import export_to_hf
from test_convert_export_hf import pack_checkpoint

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402
from evaluation.lm_eval_adapter import SparseDecodingLM, evaluate, main  # noqa: E402

TASKS = str(REPO / "tests" / "data" / "lm_eval_tasks")
LOGLIKELIHOOD_ATOL = 1e-3  # a sum of a few fp32 log-probs; the logits themselves agree within 1e-4


@pytest.fixture(autouse=True)
def offline_from_the_repository_root(monkeypatch):
    monkeypatch.chdir(REPO)  # the task YAMLs name their data files from the repository root
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def reference_results(folder, tasks, limit):
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={folder},dtype=float32,device=cpu",
                                   tasks=tasks, limit=limit, task_manager=TaskManager(include_path=TASKS),
                                   log_samples=True, batch_size=4)


def responses(samples):
    """Per document (in document order): its filtered responses, log-likelihoods as floats."""
    def plain(r):
        return float(r[0]) if isinstance(r, (tuple, list)) else (float(r) if isinstance(r, float) else r)
    return [[plain(r) for r in s["filtered_resps"]] for s in sorted(samples, key=lambda s: s["doc_id"])]


def assert_agree(ours, reference, tasks):
    for task in tasks:
        got, want = ours["results"][task], reference["results"][task]
        for metric in ("acc,none", "acc_norm,none", "exact_match,none"):
            if metric in want:
                assert got[metric] == want[metric], (task, metric)
        for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
            if metric in want:
                assert got[metric] == pytest.approx(want[metric], rel=1e-4), (task, metric)
        for ours_doc, reference_doc in zip(responses(ours["samples"][task]), responses(reference["samples"][task]),
                                           strict=True):
            for a, b in zip(ours_doc, reference_doc, strict=True):
                if isinstance(b, float):
                    assert a == pytest.approx(b, abs=LOGLIKELIHOOD_ATOL), task
                else:
                    assert a == b, task


def test_scores_agree_with_lm_evals_hf_model_on_the_exported_folder(smollm2_checkpoint, tmp_path):
    tasks = ["sd_tiny_mc", "sd_tiny_gen", "sd_tiny_text"]
    export_to_hf(smollm2_checkpoint, tmp_path / "hf")
    ours = evaluate(smollm2_checkpoint, tasks, limit=3, include_path=TASKS, batch_size=3, log_samples=True)
    assert_agree(ours, reference_results(tmp_path / "hf", tasks, limit=3), tasks)
    assert ours["results"]["sd_tiny_mc"]["acc,none"] >= 0.5  # SmolLM2 knows these


def test_a_packed_checkpoint_agrees_with_its_exported_folder(smollm2_checkpoint, tmp_path):
    packed = pack_checkpoint(smollm2_checkpoint, tmp_path / "packed.pth")
    assert "sparsity" in load_checkpoint(packed)[2]
    export_to_hf(packed, tmp_path / "hf")
    ours = evaluate(packed, ["sd_tiny_mc"], limit=2, include_path=TASKS, log_samples=True)
    assert_agree(ours, reference_results(tmp_path / "hf", ["sd_tiny_mc"], limit=2), ["sd_tiny_mc"])


def test_empty_context_is_conditioned_on_the_prefix_token(smollm2_checkpoint):
    lm = SparseDecodingLM(smollm2_checkpoint)
    request = Instance("loglikelihood", {}, ("", "Hello world"), 0)
    (score, _), = lm.loglikelihood([request], disable_tqdm=True)
    ids = lm.tok_encode("Hello world")
    tokens = torch.tensor([[lm.prefix_token_id] + ids])
    lm.model.setup_caches(1, tokens.shape[1])
    with torch.no_grad():
        log_probs = torch.log_softmax(lm.model(tokens, torch.arange(tokens.shape[1])).double(), -1)[0, :-1]
    assert score == pytest.approx(float(log_probs.gather(-1, tokens[0, 1:, None]).sum()), abs=1e-4)


def test_cli_bad_input_is_one_line(tmp_path, capsys):
    for argv, fragment in [(["--checkpoint", str(tmp_path / "nope.pth"), "--tasks", "boolq"], "checkpoint not found"),
                           (["--checkpoint", __file__, "--tasks", "x", "--include_path", str(tmp_path / "no")],
                            "is not a folder"),
                           (["--checkpoint", __file__, "--tasks", "x", "--batch_size", "0"], "must be a positive")]:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert fragment in capsys.readouterr().err


def test_cli_unknown_task_is_one_line_before_loading(smollm2_checkpoint, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--checkpoint", str(smollm2_checkpoint), "--tasks", "no_such_task", "--include_path", TASKS])
    assert exit_info.value.code == 2
    assert "unknown lm-eval task 'no_such_task'" in capsys.readouterr().err


def test_cli_offline_datasets_are_one_line_before_the_model_loads(smollm2_checkpoint, capsys, monkeypatch):
    """A hub task on a machine without the hub (offline mode, so nothing is fetched even online)."""
    import evaluation.lm_eval_adapter as adapter
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(adapter, "SparseDecodingLM", lambda *a, **k: pytest.fail("loaded the model"))
    with pytest.raises(SystemExit) as exit_info:
        main(["--checkpoint", str(smollm2_checkpoint), "--tasks", "boolq"])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert "cannot fetch the datasets of boolq" in lines[-1] and "Traceback" not in "".join(lines)


def scored_requests():
    contexts = ["The capital of France is", "Question: How many legs does a spider have?\nAnswer:"]
    return ([Instance("loglikelihood", {}, (c, x), i) for i, (c, x) in
             enumerate((c, x) for c in contexts for x in (" Paris", " Eight", " a very long answer indeed"))],
            [Instance("loglikelihood_rolling", {}, ("Once upon a time, there was a little girl named Lily.",), 0)])


@pytest.fixture
def small_travelling_checkpoint(stories260k_dir, tmp_path):
    """A random two-layer Llama with stories260K's 512-token tokenizer, in widths the bitmask packs
    (stories260K's own 172 is not a multiple of 32): it needs only the shared folder's few MB, so it
    reaches a GPU machine where SmolLM2's package is not installed."""
    from checkpoint import save_checkpoint
    from convert import convert_llama2c
    from model import Transformer

    convert_llama2c(stories260k_dir / "stories260K.bin", tmp_path)  # the tokenizer files beside model.pth
    _, config, metadata = load_checkpoint(tmp_path / "model.pth")
    config = dataclasses.replace(config, n_layer=2, intermediate_size=192)
    torch.manual_seed(0)
    state_dict = Transformer(config).state_dict()
    for name, tensor in state_dict.items():  # a trained model's scale: log-probs near log(1/512) per token
        if tensor.dim() == 2:
            tensor.normal_(0, 0.02)
    save_checkpoint(tmp_path / "model.pth", state_dict, config, metadata)
    return tmp_path / "model.pth"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("packed, dtype, atol", [(False, "float32", 1e-3), (True, "bfloat16", 5e-2)])
def test_gpu_compiled_scores_match_eager(small_travelling_checkpoint, tmp_path, packed, dtype, atol):
    """On CUDA the scoring forward is compiled (and a packed model runs the sparse kernels): its
    log-likelihoods against the eager model's, on the CPU in float32, on the GPU in bfloat16."""
    dense = small_travelling_checkpoint
    checkpoint = pack_checkpoint(dense, tmp_path / "packed.pth") if packed else dense
    reference_device = "cuda" if dtype == "bfloat16" else "cpu"
    pairs, rolling = scored_requests()
    compiled = SparseDecodingLM(checkpoint, device="cuda", dtype=dtype, batch_size=4, compile=True)
    eager = SparseDecodingLM(checkpoint, device=reference_device, dtype=dtype, batch_size=4, compile=False)
    for got, want in zip(compiled.loglikelihood(pairs), eager.loglikelihood(pairs), strict=True):
        assert got[0] == pytest.approx(want[0], abs=atol)
    assert compiled.loglikelihood_rolling(rolling)[0] == pytest.approx(eager.loglikelihood_rolling(rolling)[0], rel=1e-2)
