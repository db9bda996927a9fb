"""The layer-sequential driver and the CLI: packed checkpoints that load through generate.py and
reproduce the masked dense model, the sequential protocol against a from-scratch reference,
interrupts that leave nothing behind, one read of the checkpoint per run, and bad command lines."""
import subprocess
import sys

import pytest
import torch

import prune.run
from checkpoint import load_checkpoint, save_checkpoint
from model import ModelArgs, Transformer
from prune.calibration import CalibrationSet, prompt_digest
from prune import prune_model, read_source
from prune.run import main
from prune.wanda import wanda_prune
from sparse import unpack

LINEARS = ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    config = ModelArgs(block_size=128, vocab_size=80, n_layer=2, n_head=4, n_local_heads=2, dim=64,
                       intermediate_size=96, tie_embeddings=True)
    model = Transformer(config)
    path = tmp_path_factory.mktemp("source") / "model.pth"
    save_checkpoint(path, model.state_dict(), config, {"note": "tiny random"})
    return path


def calibration_set(seed=0, n=6):
    """Random sequences whose first few positions play the prompt (not counted)."""
    g = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, 80, (int(L),), generator=g) for L in torch.randint(20, 50, (n,), generator=g)]
    counted = [torch.arange(len(s)) >= 5 for s in sequences]
    return CalibrationSet(sequences, counted, {"kind": "test"})


def prune_checkpoint(path, calibration, method, pattern, out, **options):
    """What python -m prune does after calibrating: read the source once, prune it, save the result."""
    source = read_source(path)
    pruned = prune_model(source.model, calibration, method, pattern, metadata=source.provenance(), **options)
    pruned.save(out)


def dense_model(path):
    state_dict, config, _ = load_checkpoint(path)
    model = Transformer(config)
    model.load_state_dict(state_dict, strict=False)
    return model.eval()


def logits(model, tokens):
    model.setup_caches(1, tokens.numel())
    with torch.no_grad():
        return model(tokens[None], torch.arange(tokens.numel()))[0]


@pytest.mark.parametrize("method", ["sparsegpt", "wanda", "magnitude"])
def test_packed_checkpoint_loads_through_generate_and_matches_the_masked_dense_model(method, tiny_checkpoint, tmp_path):
    generate = pytest.importorskip("generate")
    out = tmp_path / "pruned.pth"
    prune_checkpoint(tiny_checkpoint, calibration_set(), method, "2:4", out, batch_tokens=100)
    state_dict, _, metadata = load_checkpoint(out)
    assert metadata["sparsity"] == {"pattern": "2:4", "format": "bitmask-v2",
                                    "layers": [f"layers.{i}.{n}" for i in range(2) for n in LINEARS]}
    assert metadata["method"] == method and metadata["note"] == "tiny random"
    assert metadata["calibration"]["counted_tokens"] == calibration_set().counted_tokens
    assert metadata["source_checkpoint"] == str(tiny_checkpoint.resolve())

    source = dense_model(tiny_checkpoint)
    masked = dense_model(tiny_checkpoint)
    for name in metadata["sparsity"]["layers"]:
        weight = unpack(state_dict[f"{name}.values"], state_dict[f"{name}.mask"])
        keep = weight != 0
        assert (keep.reshape(keep.shape[0], -1, 4).sum(-1) == 2).all(), name  # 2:4 exactly (random weights: no zeros kept)
        if method != "sparsegpt":  # no weight update: the kept weights are the source's
            original = source.get_submodule(name).weight.detach()
            assert torch.equal(weight, original * keep), name
        masked.get_submodule(name).weight.data = weight
    loaded = generate.load_model(out, "cpu", torch.float32)
    tokens = torch.randint(0, 80, (24,), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(logits(loaded, tokens), logits(masked, tokens), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits(source, tokens), logits(masked, tokens), atol=1e-3)


def test_packed_qwen2_checkpoint_keeps_its_biases_dense_and_generates_like_the_masked_dense_model(tmp_path):
    """Qwen2's q/k/v biases stay dense beside the packed wqkv, load into SparseLinear's bias, and the
    packed model decodes the tokens of the dense model with the same masked weights and biases."""
    generate = pytest.importorskip("generate")
    from sparse import SparseLinear
    torch.manual_seed(0)
    config = ModelArgs(architecture="qwen2", qkv_bias=True, block_size=128, vocab_size=80, n_layer=2, n_head=4,
                       n_local_heads=2, dim=64, intermediate_size=96, tie_embeddings=True)
    model = Transformer(config)
    for layer in model.layers:  # nn.Linear's default bias is small: make it count
        torch.nn.init.normal_(layer.attention.wqkv.bias, 0, 0.5)
    source = tmp_path / "qwen2.pth"
    save_checkpoint(source, model.state_dict(), config, {})
    out = tmp_path / "pruned.pth"
    prune_checkpoint(source, calibration_set(), "sparsegpt", "2:4", out, batch_tokens=100)
    state_dict, _, metadata = load_checkpoint(out)
    for i in range(2):
        assert torch.equal(state_dict[f"layers.{i}.attention.wqkv.bias"], model.layers[i].attention.wqkv.bias)
    masked = dense_model(source)
    for name in metadata["sparsity"]["layers"]:
        masked.get_submodule(name).weight.data = unpack(state_dict[f"{name}.values"], state_dict[f"{name}.mask"])
    loaded = generate.load_model(out, "cpu", torch.float32)
    assert isinstance(loaded.layers[0].attention.wqkv, SparseLinear)
    assert torch.equal(loaded.layers[0].attention.wqkv.bias, model.layers[0].attention.wqkv.bias)
    prompts = [torch.randint(0, 80, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 12)]
    ours = generate.generate(loaded, prompts, 24).new_tokens
    expected = generate.generate(masked, prompts, 24).new_tokens
    assert [t.tolist() for t in ours] == [t.tolist() for t in expected]
    tokens = torch.cat(prompts)
    torch.testing.assert_close(logits(loaded, tokens), logits(masked, tokens), rtol=1e-4, atol=1e-4)
    masked_without_bias = dense_model(source)
    masked_without_bias.load_state_dict(masked.state_dict())
    for layer in masked_without_bias.layers:
        layer.attention.wqkv.bias.data.zero_()
    assert not torch.allclose(logits(masked_without_bias, tokens), logits(masked, tokens), atol=1e-3)


def test_checkpoint_in_the_older_bitmask_v1_layout_still_loads(tiny_checkpoint, tmp_path):
    # bitmask-v1, the older layout, stored each row's kept values as column (word, step) of a
    # (in/32 * nnz, out) buffer; load_model converts it to the current layout.
    generate = pytest.importorskip("generate")
    from checkpoint import save_checkpoint

    out = tmp_path / "pruned.pth"
    prune_checkpoint(tiny_checkpoint, calibration_set(), "magnitude", "4:8", out, batch_tokens=100)
    state_dict, config, metadata = load_checkpoint(out)
    old = {name: (unpack(tensor, state_dict[name[:-len("values")] + "mask"]) if name.endswith(".values") else tensor)
           for name, tensor in state_dict.items()}
    old = {name: (tensor[tensor != 0].reshape(tensor.shape[0], -1).t().contiguous() if name.endswith(".values")
                  else tensor) for name, tensor in old.items()}  # random weights: no kept zeros
    save_checkpoint(tmp_path / "v1.pth", old, config, dict(metadata, sparsity=dict(metadata["sparsity"],
                                                                                      format="bitmask-v1")))
    tokens = torch.randint(0, 80, (24,), generator=torch.Generator().manual_seed(4))
    expected = logits(generate.load_model(out, "cpu", torch.float32), tokens)
    torch.testing.assert_close(logits(generate.load_model(tmp_path / "v1.pth", "cpu", torch.float32), tokens),
                               expected, rtol=0, atol=0)


def test_a_mask_that_breaks_its_pattern_is_refused_on_load(tiny_checkpoint, tmp_path):
    generate = pytest.importorskip("generate")
    from checkpoint import CheckpointError, save_checkpoint

    out = tmp_path / "pruned.pth"
    prune_checkpoint(tiny_checkpoint, calibration_set(), "magnitude", "2:4", out, batch_tokens=100)
    state_dict, config, metadata = load_checkpoint(out)
    mask = state_dict["layers.1.feed_forward.w2.mask"].clone()
    mask[0, 3] ^= 1 << 5  # one bit more or less in columns 4..7 of row 3
    save_checkpoint(tmp_path / "broken.pth", {**state_dict, "layers.1.feed_forward.w2.mask": mask}, config, metadata)
    with pytest.raises(CheckpointError, match=r"layer layers.1.feed_forward.w2: mask breaks pattern 2:4: row 3, "
                                              r"columns 4..7 keep [13] weights, expected exactly 2"):
        generate.load_model(tmp_path / "broken.pth", "cpu", torch.float32)


def wanda_by_hand(path, calibration, pattern):
    """Sequential Wanda from scratch: for each linear in forward order, run the *whole* (partly
    pruned) model KV-cached over every calibration sequence, take that linear's inputs at the
    counted positions, prune it. Independent of the driver's block replay and batching."""
    model = dense_model(path)
    for i, layer in enumerate(model.layers):
        for name in LINEARS:
            linear = layer.get_submodule(name)
            inputs = []
            hook = linear.register_forward_pre_hook(lambda module, args: inputs.append(args[0][0]))
            for sequence, counted in zip(calibration.sequences, calibration.counted):
                logits(model, sequence)
                inputs[-1] = inputs[-1][counted]
            hook.remove()
            X = torch.cat(inputs).double()
            linear.weight.data, _ = wanda_prune(linear.weight.data, (X * X).sum(0), pattern)
    return model


@pytest.mark.parametrize("pattern", ["2:4", "50%"])
def test_sequential_driver_matches_a_from_scratch_reference(pattern, tiny_checkpoint, tmp_path):
    calibration = calibration_set(seed=1)
    out = tmp_path / "pruned.pth"
    prune_checkpoint(tiny_checkpoint, calibration, "wanda", pattern, out, batch_tokens=64)
    reference = wanda_by_hand(tiny_checkpoint, calibration, pattern)
    state_dict, _, metadata = load_checkpoint(out)
    for name in metadata["sparsity"]["layers"]:
        if pattern == "2:4":
            weight = unpack(state_dict[f"{name}.values"], state_dict[f"{name}.mask"])
        else:
            weight = state_dict[f"{name}.weight"]
            assert (weight == 0).sum() == weight.numel() // 2  # dense zeros, exactly half (per row: 50%)
        assert torch.equal(weight != 0, reference.get_submodule(name).weight != 0), name
    assert metadata["sparsity"]["format"] == ("bitmask-v2" if pattern == "2:4" else "dense-zeros")


def test_one_shot_calibrates_on_dense_activations(tiny_checkpoint, tmp_path):
    calibration = calibration_set(seed=2)
    prune_checkpoint(tiny_checkpoint, calibration, "sparsegpt", "2:4", tmp_path / "seq.pth", batch_tokens=64)
    prune_checkpoint(tiny_checkpoint, calibration, "sparsegpt", "2:4", tmp_path / "one.pth", batch_tokens=64, one_shot=True)
    sequential, _, meta_seq = load_checkpoint(tmp_path / "seq.pth")
    one_shot, _, meta_one = load_checkpoint(tmp_path / "one.pth")
    assert meta_seq["calibration"]["collection"] == "sequential" and meta_one["calibration"]["collection"] == "one-shot"
    # The first linear sees the same (dense) inputs either way; later ones differ.
    first, later = "layers.0.attention.wqkv.values", "layers.1.feed_forward.w2.values"
    torch.testing.assert_close(sequential[first], one_shot[first])
    assert not torch.allclose(sequential[later], one_shot[later])


def test_include_exclude_keep_other_linears_dense(tiny_checkpoint, tmp_path):
    out = tmp_path / "pruned.pth"
    prune_checkpoint(tiny_checkpoint, calibration_set(), "magnitude", "4:8", out, exclude=["*.w2", "layers.1.*"])
    state_dict, _, metadata = load_checkpoint(out)
    assert metadata["sparsity"]["layers"] == ["layers.0.attention.wqkv", "layers.0.attention.wo",
                                              "layers.0.feed_forward.w13"]
    source, _, _ = load_checkpoint(tiny_checkpoint)
    for name in ("layers.0.feed_forward.w2.weight", "layers.1.attention.wqkv.weight", "tok_embeddings.weight"):
        assert torch.equal(state_dict[name], source[name])


def test_interrupt_mid_run_leaves_no_output(tiny_checkpoint, tmp_path, monkeypatch):
    calls = []

    def interrupted(weight, stats, pattern):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return prune.run.magnitude_prune(weight, pattern)

    monkeypatch.setitem(prune.run.METHODS, "magnitude", interrupted)
    out_dir = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        prune_checkpoint(tiny_checkpoint, calibration_set(), "magnitude", "2:4", out_dir / "pruned.pth")
    assert not out_dir.exists() or not any(out_dir.iterdir())


def test_interrupt_while_writing_leaves_no_output(tiny_checkpoint, tmp_path, monkeypatch):
    def half_written(obj, path):
        open(path, "wb").write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", half_written)
    with pytest.raises(KeyboardInterrupt):
        prune_checkpoint(tiny_checkpoint, calibration_set(), "magnitude", "2:4", tmp_path / "out" / "pruned.pth")
    assert not any((tmp_path / "out").iterdir())


def test_a_pruned_checkpoint_is_refused_as_a_source(tiny_checkpoint, tmp_path):
    from checkpoint import CheckpointError

    prune_checkpoint(tiny_checkpoint, calibration_set(), "magnitude", "50%", tmp_path / "pruned.pth")
    with pytest.raises(CheckpointError, match="is already pruned \\(50%\\); prune the dense source checkpoint"):
        read_source(tmp_path / "pruned.pth")


@pytest.mark.parametrize("argv, message", [
    (["--checkpoint", "missing.pth"], "checkpoint not found"),
    (["--pattern", "3:5"], "bad sparsity pattern"),
    (["--method", "sparsegpt", "--include", "nothing.*"], "no block linear matches"),
    (["--pattern", "2:4", "--include", "layers.0.*"], None),  # fine up to the tokenizer step
])
def test_cli_bad_inputs_exit_with_one_line(argv, message, tiny_checkpoint, tmp_path, monkeypatch, capsys):
    base = ["--checkpoint", str(tiny_checkpoint), "--calib", "text", "--text", str(tmp_path / "missing.txt"),
            "--out", str(tmp_path / "x.pth")]
    if message is None:  # get past the checks: then the missing text file is the error
        pytest.importorskip("tokenizer")
        monkeypatch.setattr("tokenizer.find_tokenizer", lambda path, metadata=None: path)
        monkeypatch.setattr("tokenizer.load_tokenizer", lambda path: None)
        message = "text file not found"
    assert_exits_with_one_line(lambda: main(base + argv), capsys, "prune: error:", message)
    assert not (tmp_path / "x.pth").exists()


def assert_exits_with_one_line(run, capsys, prefix, message):
    """run() exits with code 2 and one line on stderr starting with prefix and holding message."""
    with pytest.raises(SystemExit) as exit_info:
        run()
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix) and message in lines[0], lines


@pytest.mark.parametrize("argv", [["--calib", "decode"], ["--calib", "reference"], ["--calib", "generated"],
                                  ["--calib", "text", "--text", "t.txt", "--tokens", "0"],
                                  ["--method", "obs"]])
def test_cli_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--checkpoint", "m.pth", "--out", "o.pth"] + argv)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_cli_error_has_no_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "prune", "--checkpoint", str(tmp_path / "none.pth"), "--calib",
                             "text", "--text", "t.txt", "--out", str(tmp_path / "o.pth")],
                            capture_output=True, text=True, cwd=prune.run.__file__.rsplit("/prune/", 1)[0])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"prune: error: checkpoint not found: {tmp_path / 'none.pth'}"]


@pytest.mark.parametrize("flag, value, message", [
    ("--temperature", "-1", "must be >= 0"), ("--temperature", "nan", "must be finite"),
    ("--temperature", "inf", "must be finite"), ("--top_p", "0", "must be in (0, 1]"),
    ("--top_p", "1.5", "must be in (0, 1]"), ("--top_k", "0", "must be >= 1 or 'off'"),
    ("--top_k", "many", "expected an integer"), ("--tokens", "-5", "must be a positive integer"),
    ("--max_new_tokens", "0", "must be a positive integer"), ("--batch_size", "0", "must be a positive integer"),
    ("--batch_tokens", "0", "must be a positive integer"), ("--seq_len", "0", "must be a positive integer"),
    ("--max_new_tokens", "1", "--max_new_tokens >= 2"), ("--device", "gpu", "expected cpu, cuda or cuda:N"),
])
def test_cli_refuses_bad_sampling_and_budgets_before_reading_anything(flag, value, message, tmp_path, monkeypatch,
                                                                       capsys):
    monkeypatch.setattr(prune.run, "read_source", lambda path: pytest.fail("read the checkpoint"))
    argv = ["--checkpoint", str(tmp_path / "m.pth"), "--calib", "decode", "--prompts", "p.txt",
            "--out", str(tmp_path / "o.pth"), flag, value]
    assert_exits_with_one_line(lambda: main(argv), capsys, "python -m prune: error:", message)


def test_cli_top_k_off_means_no_top_k_cut():
    args = prune.run.parse_args(["--checkpoint", "m.pth", "--prompts", "p.txt", "--out", "o.pth", "--top_k", "off"])
    assert args.top_k is None


@pytest.mark.parametrize("link", ["same path", "hard link", "symlink"])
def test_cli_refuses_out_that_is_the_input(link, tiny_checkpoint, tmp_path, monkeypatch, capsys):
    source = tmp_path / "model.pth"
    source.write_bytes(tiny_checkpoint.read_bytes())
    out = {"same path": source, "hard link": tmp_path / "hard.pth", "symlink": tmp_path / "link.pth"}[link]
    if link == "hard link":
        out.hardlink_to(source)
    elif link == "symlink":
        out.symlink_to(source)
    monkeypatch.setattr(prune.run, "read_source", lambda path: pytest.fail("read the checkpoint"))
    argv = ["--checkpoint", str(source), "--calib", "text", "--text", "t.txt", "--out", str(out)]
    assert_exits_with_one_line(lambda: main(argv), capsys, "prune: error:", "would destroy the input")
    assert source.read_bytes() == tiny_checkpoint.read_bytes()


def test_cli_refuses_out_that_is_the_prompt_file(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    argv = ["--checkpoint", str(tmp_path / "m.pth"), "--prompts", str(prompts), "--out", str(prompts)]
    assert_exits_with_one_line(lambda: main(argv), capsys, "prune: error:", "would destroy the input")
    assert prompts.read_text() == "hello\n"


@pytest.mark.parametrize("out, message", [(".", "is a directory"), ("a_file/pruned.pth", "a_file is a file, not a folder")])
def test_cli_refuses_an_output_it_cannot_write_before_any_work(out, message, tiny_checkpoint, tmp_path, monkeypatch,
                                                                capsys):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setattr(prune.run, "read_source", lambda path: pytest.fail("read the checkpoint"))
    argv = ["--checkpoint", str(tiny_checkpoint), "--calib", "text", "--text", "t.txt", "--out", str(tmp_path / out)]
    assert_exits_with_one_line(lambda: main(argv), capsys, "prune: error:", message)


def test_cli_random_bytes_are_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "random.pth").write_bytes(bytes(range(256)) * 64)
    argv = ["--checkpoint", str(tmp_path / "random.pth"), "--calib", "text", "--text", "t.txt",
            "--out", str(tmp_path / "o.pth")]
    assert_exits_with_one_line(lambda: main(argv), capsys, "prune: error:", f"not a checkpoint: {tmp_path / 'random.pth'}")


def test_saving_writes_one_file_and_never_another_models_config(tiny_checkpoint, tmp_path):
    """The pruned checkpoint carries its config inside; a folder it is written into keeps its own files."""
    other_config = '{"note": "another model\'s config"}\n'
    (tmp_path / "config.json").write_text(other_config)
    prune_checkpoint(tiny_checkpoint, calibration_set(), "magnitude", "2:4", tmp_path / "pruned.pth")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "pruned.pth"]
    assert (tmp_path / "config.json").read_text() == other_config
    assert load_checkpoint(tmp_path / "pruned.pth")[1] == load_checkpoint(tiny_checkpoint)[1]


def test_save_refuses_to_overwrite_its_source(tiny_checkpoint, tmp_path):
    source = tmp_path / "model.pth"
    source.write_bytes(tiny_checkpoint.read_bytes())
    with pytest.raises(ValueError, match="would destroy the input"):
        prune_checkpoint(source, calibration_set(), "magnitude", "2:4", source)
    assert source.read_bytes() == tiny_checkpoint.read_bytes()


@pytest.fixture(scope="module")
def checkpoints_with_tokenizer(tmp_path_factory):
    """Two random 512-token models (pruned one, generator) beside stories260K's tokenizer."""
    import shutil
    from tests.conftest import STORIES260K_DIR
    if not (STORIES260K_DIR / "tok512.bin").is_file():
        pytest.skip(f"stories260K's tokenizer is not at {STORIES260K_DIR}")
    folder = tmp_path_factory.mktemp("with_tokenizer")
    shutil.copy(STORIES260K_DIR / "tok512.bin", folder / "tok512.bin")
    config = ModelArgs(block_size=256, vocab_size=512, n_layer=2, n_head=4, n_local_heads=2, dim=64,
                       intermediate_size=96, tie_embeddings=True)
    paths = []
    for seed, name in ((0, "model.pth"), (1, "generator.pth")):
        torch.manual_seed(seed)
        (folder / name.split(".")[0]).mkdir()
        save_checkpoint(folder / name.split(".")[0] / name, Transformer(config).state_dict(), config,
                        {"tokenizer_dir": str(folder)})
        paths.append(folder / name.split(".")[0] / name)
    return paths


def test_cli_text_calibration(checkpoints_with_tokenizer, tmp_path):
    from tests.conftest import SHARED
    text = SHARED / "data" / "wikitext2_test.raw"
    if not text.is_file():
        pytest.skip(f"{text} is absent")
    target, _ = checkpoints_with_tokenizer
    out = tmp_path / "pruned.pth"
    main(["--checkpoint", str(target), "--method", "wanda", "--pattern", "50%", "--calib", "text", "--text", str(text),
          "--tokens", "300", "--seq_len", "64", "--device", "cpu", "--out", str(out)])
    state_dict, _, metadata = load_checkpoint(out)
    assert metadata["calibration"]["kind"] == "text" and metadata["calibration"]["counted_tokens"] == 5 * 64
    assert metadata["calibration"]["mix"] == {"counted_tokens": 320,
                                              "domains": {"wikitext2_test": {"tokens": 320, "prompt_tokens": 0}}}
    assert metadata["tokenizer_dir"] == str(target.parent.parent.resolve())
    assert (state_dict["layers.1.feed_forward.w2.weight"] == 0).float().mean() == 0.5


@pytest.mark.parametrize("calib, counted", [("decode", 14), ("decode_first", 16), ("generated", None)])
def test_cli_cross_model_decode_calibration(calib, counted, checkpoints_with_tokenizer, tmp_path):
    target, generator = checkpoints_with_tokenizer
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nThe cat sat\n")
    out = tmp_path / "pruned.pth"
    main(["--checkpoint", str(target), "--generator", str(generator), "--method", "sparsegpt", "--pattern", "2:4",
          "--calib", calib, "--prompts", str(prompts), "--tokens", "30", "--max_new_tokens", "8",
          "--batch_size", "2", "--greedy", "--device", "cpu", "--out", str(out)])
    _, _, metadata = load_checkpoint(out)
    calibration = metadata["calibration"]
    assert calibration["kind"] == calib and calibration["sampling"] == {"greedy": True}
    assert calibration["generator"] == str(generator.resolve()) and calibration["prompt_file"] == str(prompts)
    # greedy: one pass over 2 prompts, 7 decode steps each; decode_first adds each first position;
    # generated counts every position of the same two sequences, under the budget of 30: both prompts too
    from tokenizer import load_tokenizer
    tokenizer = load_tokenizer(target.parent.parent / "tok512.bin")
    prompt_lengths = sum(len(tokenizer.encode(p, bos=True)) for p in ("Once upon a time", "The cat sat"))
    counted = counted or 14 + prompt_lengths
    assert calibration["counted_tokens"] == counted == calibration["mix"]["counted_tokens"]
    prompt_tokens = calibration["mix"]["domains"]["prompts"]["prompt_tokens"]
    assert prompt_tokens == {"decode": 0, "decode_first": 2, "generated": prompt_lengths}[calib]
    assert calibration.get("first_position_counted", False) == (calib == "decode_first")


def test_cli_same_seed_gives_the_same_checkpoint_and_another_seed_another(checkpoints_with_tokenizer, tmp_path):
    """Sampled decode-aware calibration is reproducible from --seed: two runs write identical weights."""
    # Untied: a tied random model repeats its input token whatever the seed, so seeds could not differ.
    config = ModelArgs(block_size=256, vocab_size=512, n_layer=2, n_head=4, n_local_heads=2, dim=64,
                       intermediate_size=96, tie_embeddings=False)
    torch.manual_seed(0)
    target = tmp_path / "untied" / "model.pth"
    target.parent.mkdir()
    save_checkpoint(target, Transformer(config).state_dict(), config,
                    {"tokenizer_dir": str(checkpoints_with_tokenizer[0].parent.parent)})
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nThe cat sat\n")

    def pruned_weights(seed, run):
        out = tmp_path / f"pruned-seed{seed}-run{run}.pth"
        main(["--checkpoint", str(target), "--method", "sparsegpt", "--pattern", "2:4", "--calib", "decode",
              "--prompts", str(prompts), "--tokens", "40", "--max_new_tokens", "12", "--batch_size", "2",
              "--seed", str(seed), "--device", "cpu", "--out", str(out)])
        return load_checkpoint(out)[0]

    first, again, other = pruned_weights(0, 1), pruned_weights(0, 2), pruned_weights(1, 1)
    assert first.keys() == again.keys()
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert any(not torch.equal(first[name], other[name]) for name in first if name.startswith("layers."))


def test_cli_reference_calibration_reads_prompts_with_their_answers(checkpoints_with_tokenizer, tmp_path):
    target, _ = checkpoints_with_tokenizer
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Tell a story", "domain": "writing"}\n'
                       '{"text": "Add two numbers", "code": "def add(a, b):\\n    return a + b"}\n')
    out = tmp_path / "pruned.pth"
    main(["--checkpoint", str(target), "--method", "wanda", "--pattern", "2:4", "--calib", "reference", "--prompts",
          str(prompts), "--tokens", "12", "--device", "cpu", "--out", str(out)])
    calibration = load_checkpoint(out)[2]["calibration"]
    assert calibration["kind"] == "reference" and calibration["counted_tokens"] == 12
    assert set(calibration["mix"]["domains"]) == {"writing", "prompts"}
    assert calibration["prompt_sha256"] == [prompt_digest("Tell a story"), prompt_digest("Add two numbers")]


@pytest.mark.parametrize("calib", ["text", "decode"])
def test_cli_reads_the_checkpoint_once(calib, checkpoints_with_tokenizer, tmp_path, monkeypatch):
    """The source is read once per run: the decode calibration's generator (by default the source
    model) is a copy of what was read, not a second load."""
    target, _ = checkpoints_with_tokenizer
    text = tmp_path / "text.txt"
    text.write_text("Once upon a time there was a little girl named Lily. She liked to play in the park.\n" * 40)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nThe cat sat\n")
    source = ["--text", str(text), "--seq_len", "32"] if calib == "text" else \
        ["--prompts", str(prompts), "--max_new_tokens", "8", "--batch_size", "2"]
    reads, real_load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda f, *args, **kwargs: reads.append(str(f)) or real_load(f, *args, **kwargs))
    main(["--checkpoint", str(target), "--method", "wanda", "--pattern", "2:4", "--calib", calib, *source,
          "--tokens", "64", "--device", "cpu", "--out", str(tmp_path / "pruned.pth")])
    assert reads.count(str(target)) == 1
    assert load_checkpoint(tmp_path / "pruned.pth")[2]["calibration"]["kind"] == calib


def test_cli_rejects_a_generator_with_another_vocabulary(checkpoints_with_tokenizer, tiny_checkpoint, tmp_path, capsys):
    target, _ = checkpoints_with_tokenizer
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    assert_exits_with_one_line(lambda: main([
        "--checkpoint", str(target), "--generator", str(tiny_checkpoint), "--prompts", str(prompts),
        "--tokens", "10", "--device", "cpu", "--out", str(tmp_path / "o.pth")]), capsys, "prune: error:",
        "must share a tokenizer")


@pytest.mark.slow
def test_cli_decode_calibration_on_smollm2(smollm2_checkpoint, tmp_path, capsys):
    """The whole path on the real default model: chat-templated prompts, sampled generation,
    decode-only statistics, packed output that generate.py loads (two blocks pruned to stay fast)."""
    import generate
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Write a haiku about the sea."}\n{"prompt": "Name three primes."}\n')
    out = tmp_path / "pruned.pth"
    main(["--checkpoint", str(smollm2_checkpoint), "--method", "sparsegpt", "--pattern", "2:4", "--calib", "decode",
          "--prompts", str(prompts), "--tokens", "40", "--max_new_tokens", "16", "--batch_size", "2",
          "--include", "layers.0.*", "layers.1.*", "--device", "cpu", "--out", str(out)])
    assert "wrote" in capsys.readouterr().out
    state_dict, _, metadata = load_checkpoint(out)
    assert metadata["calibration"]["kind"] == "decode" and metadata["calibration"]["counted_tokens"] == 40
    assert metadata["calibration"]["sampling"] == {"temperature": 0.7, "top_k": 20, "top_p": 0.8}
    assert metadata["tokenizer_dir"] == str(smollm2_checkpoint.parent.resolve())
    assert len(metadata["sparsity"]["layers"]) == 8 and "layers.2.attention.wqkv.weight" in state_dict
    model = generate.load_model(out, "cpu", torch.float32)
    result = generate.generate(model, [torch.tensor([1, 2, 3])], 4)
    assert len(result.new_tokens[0]) == 4
