"""tp.py: tensor parallel over 2 and 4 CPU processes (gloo) gives the single-process model's logits
and greedy tokens, dense (with a q/k/v bias), Qwen3 (q/k norms, tied lm_head) and packed 2:4 / 8:16,
at batch 1 and 3 (left-padded); the refusals; and torchrun + generate.py end to end."""
import subprocess
import sys

import pytest
import torch

import tp
from checkpoint import save_checkpoint
from model import ModelArgs, Transformer
from tests.tp_testing import BATCHES, KINDS, REPO, SHAPE, launch, run_every_case, tiny_model


@pytest.fixture(scope="module")
def reference():
    return run_every_case(tiny_model)


@pytest.fixture(scope="module", params=[2, 4])
def sharded(request, tmp_path_factory):
    """world size, and each rank's results (all kinds and batches from one launch)."""
    out = tmp_path_factory.mktemp(f"tp{request.param}")
    done = launch(request.param, [sys.executable, str(REPO / "tests" / "tp_testing.py"), str(out)])
    for rank, result in enumerate(done):
        assert result.returncode == 0, f"rank {rank}: {result.stderr[-3000:]}"
    return request.param, [torch.load(out / f"rank{r}.pt") for r in range(request.param)]


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("kind", list(KINDS))
def test_sharded_logits_and_greedy_tokens_equal_one_process(sharded, reference, kind, batch):
    world_size, ranks = sharded
    expected = reference[kind, batch]
    for rank, results in enumerate(ranks):
        got = results[kind, batch]
        assert len(got["logits"]) == len(expected["logits"])
        for step, (a, b) in enumerate(zip(got["logits"], expected["logits"])):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m: f"W={world_size} rank {rank} step {step}: {m}")
        assert torch.equal(got["tokens"], expected["tokens"])
        assert all(torch.equal(g, e) for g, e in zip(got["generated"], expected["generated"]))


def test_every_rank_samples_the_same_tokens_without_a_seed(sharded):
    world_size, ranks = sharded
    first, second = ranks[0]["sampled"]
    for results in ranks[1:]:
        assert all(torch.equal(a, b) for call, ours in zip(results["sampled"], (first, second)) for a, b in zip(call, ours))
    assert any(not torch.equal(a, b) for a, b in zip(first, second))  # the generator moves on between calls


def test_the_shard_holds_a_share_of_every_split_layer():
    model = tp.shard(tiny_model("2:4"), rank_index=1, ranks=4)
    attention, feed_forward = model.layers[0].attention, model.layers[0].feed_forward
    assert (attention.n_head, attention.n_local_heads, feed_forward.intermediate_size) == (2, 1, 32)
    assert attention.wqkv.out_features == (2 + 2 * 1) * 16 and attention.wo.linear.in_features == 32
    assert feed_forward.w13.out_features == 64 and feed_forward.w2.linear.in_features == 32
    assert model.output.linear.out_features == 25  # ceil(98 / 4), the last rank's padded
    model.setup_caches(3, 16)
    assert attention.kv_cache.k_cache.shape == (3, 1, 16, 16)


def test_packed_slices_unpack_to_the_dense_slices():
    """A rank's packed wo / w2 / wqkv is exactly the slice of the unpacked full layer."""
    import sparse

    full = tiny_model("8:16")
    dense = {name: sparse.unpack(m.values, m.mask) for name, m in full.named_modules() if isinstance(m, sparse.SparseLinear)}
    model = tp.shard(tiny_model("8:16"), rank_index=2, ranks=4)
    layer = model.layers[1]
    assert torch.equal(sparse.unpack(layer.attention.wo.linear.values, layer.attention.wo.linear.mask),
                       dense["layers.1.attention.wo"][:, 64:96])
    assert torch.equal(sparse.unpack(layer.feed_forward.w2.linear.values, layer.feed_forward.w2.linear.mask),
                       dense["layers.1.feed_forward.w2"][:, 64:96])
    wqkv = dense["layers.1.attention.wqkv"]  # q heads 4, 5 (rows 64..96), KV head 2 of k (128 + 32..48) and v (192 + ...)
    assert torch.equal(sparse.unpack(layer.attention.wqkv.values, layer.attention.wqkv.mask),
                       torch.cat([wqkv[64:96], wqkv[160:176], wqkv[224:240]]))
    sparse.validate(layer.feed_forward.w13.values, layer.feed_forward.w13.mask, "8:16")


@pytest.mark.parametrize("shape, ranks, message", [
    (dict(n_head=8, n_local_heads=4), 3, "4 key/value heads"),
    (dict(n_head=8, n_local_heads=4, intermediate_size=130), 4, "intermediate size 130"),
])
def test_a_model_the_world_size_cannot_split_is_refused(shape, ranks, message):
    model = Transformer(ModelArgs(vocab_size=32, n_layer=1, dim=64, **shape))
    with pytest.raises(ValueError, match=message):
        tp.shard(model, rank_index=0, ranks=ranks)


def test_a_packed_split_off_32_column_words_is_refused():
    import sparse

    model = sparse.swap_to_sparse(Transformer(ModelArgs(vocab_size=32, n_layer=1, n_head=8, n_local_heads=4,
                                                        dim=64, intermediate_size=128)), "2:4")
    with pytest.raises(ValueError, match="16-column slice of the packed layer layers.0.attention.wo"):
        tp.shard(model, rank_index=0, ranks=4)


# --- torchrun + generate.py ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny checkpoints, dense (Qwen3) and packed 2:4 (one with wo's 64 input columns: 32 a rank at 2
    processes, 16 at 4, refused), each with a word-level tokenizer.json beside it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("tp_cli")
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(SHAPE["vocab_size"] - 3)])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    paths = {}
    for kind in ("dense", "2:4", "2:4-narrow"):
        (folder / kind.replace(":", "of")).mkdir()
        paths[kind] = folder / kind.replace(":", "of") / "model.pth"
        tokenizer.save(str(paths[kind].with_name("tokenizer.json")))
    model = tiny_model("qwen3")
    save_checkpoint(paths["dense"], model.state_dict(), model.config)
    for kind, packed in (("2:4", tiny_model("2:4")), ("2:4-narrow", tiny_model("2:4", dim=64, head_dim=8))):
        save_checkpoint(paths[kind], packed.state_dict(), packed.config,
                        {"sparsity": {"format": "bitmask-v2", "pattern": "2:4"}})
    return paths


GREEDY = ["--prompt", "w1 w5 w9", "--max_new_tokens", "6", "--temperature", "0", "--batch_size", "2"]


def assert_torchrun_prints_the_text_of_one_process(checkpoint, *options):
    arguments = [str(REPO / "generate.py"), "--checkpoint", str(checkpoint), *GREEDY, *options]
    single = subprocess.run([sys.executable, *arguments], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert single.returncode == 0, single.stderr
    parallel = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               *arguments], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert parallel.returncode == 0, parallel.stderr[-3000:]
    text = lambda out: [line for line in out.splitlines() if line.startswith("w") or line.startswith("-")]  # noqa: E731
    assert text(parallel.stdout) == text(single.stdout) and text(single.stdout)
    assert parallel.stdout.count("Loaded") == 1  # rank 1 prints nothing


def test_torchrun_generate_prints_the_same_greedy_text_as_one_process(checkpoints):
    assert_torchrun_prints_the_text_of_one_process(checkpoints["2:4"], "--device", "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("kind", ["dense", "2:4"])
def test_torchrun_on_two_gpus_compiled_prints_the_text_of_one_gpu(checkpoints, kind):
    """NCCL, the all-reduces inside the CUDA graph, the decode-attention kernel on each rank's heads
    and (2:4) the sparse kernels on each rank's slices; float32, so rounding cannot flip a token."""
    assert_torchrun_prints_the_text_of_one_process(checkpoints[kind], "--device", "cuda", "--dtype", "float32",
                                                   "--compile")


@pytest.mark.parametrize("kind, world_size, message", [
    ("dense", 3, "4 key/value heads to divide evenly"),
    ("2:4-narrow", 4, "16-column slice of the packed layer layers.0.attention.wo"),
])
def test_generate_refuses_a_world_size_the_model_cannot_split(checkpoints, kind, world_size, message):
    """Rank 0 alone: the refusal comes before the process group waits for the others."""
    [rank0] = launch(1, [sys.executable, str(REPO / "generate.py"), "--checkpoint", str(checkpoints[kind]), *GREEDY,
                         "--device", "cpu"],
                     timeout=120, WORLD_SIZE=str(world_size))
    lines = [line for line in rank0.stderr.splitlines() if line.strip()]
    assert rank0.returncode == 2 and len(lines) == 1 and message in lines[0], rank0.stderr


def test_more_processes_than_gpus_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="torchrun started 4 processes on this machine but it has 2 GPU"):
        tp.process_device("cuda")
    assert tp.process_device("cpu") == "cpu"
