"""generate.py: sampling filters, seeded sampling, greedy decoding against a float64 no-cache
reference, batches of different-length prompts, EOS, and the CLI's error lines. CPU, tiny models."""
import copy
import inspect
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import generate
from checkpoint import save_checkpoint
from model import ModelArgs, Transformer
from tests.sparse_kernel_testing import interpreted, relative_error

REPO = Path(__file__).resolve().parent.parent
TINY = {
    "llama": dict(block_size=64, vocab_size=48, n_layer=2, n_head=4, n_local_heads=2, dim=32, intermediate_size=48),
    "qwen3": dict(architecture="qwen3", block_size=64, vocab_size=48, n_layer=2, n_head=4, n_local_heads=2,
                  dim=32, head_dim=12, intermediate_size=48, qk_norm=True, tie_embeddings=True),
}


def tiny_model(kind="llama", seed=0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(**TINY[kind])).eval()
    with torch.no_grad():  # RMSNorm weights start at 1; perturb them so every parameter matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def random_prompt(length, seed, vocab=48):
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed))


# --- sampling ------------------------------------------------------------------------------


def test_temperature_zero_is_argmax():
    logits = torch.randn(5, 100)
    assert torch.equal(generate.sample(logits, None, temperature=0.0), logits.argmax(-1))


@pytest.mark.parametrize("chunks", [1, 7, 64])  # one slice; slices not dividing V; more slices than a row's 50
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_over_vocab_is_torch_argmax(chunks, dtype):
    scores = torch.randn(6, 50).to(dtype)
    scores[1, 10:40] = float("-inf")
    scores[2] = scores[2].round()  # ties: the first maximum wins
    scores[3, [5, 30, 49]] = 9.0  # the maximum repeated across slices
    scores[4] = float("-inf")  # nothing kept: index 0, as torch.argmax
    scores[5, 49] = 9.0  # the last token
    assert torch.equal(generate.argmax_over_vocab(scores, chunks), scores.argmax(dim=-1))
    assert torch.equal(generate.argmax_over_vocab(scores.view(2, 3, 50), chunks), scores.view(2, 3, 50).argmax(dim=-1))
    noise = generate.draw_noise(6, 50, 0.8, torch.Generator().manual_seed(1), "cpu")
    race = generate.kept_logits(scores.float(), 0.8, top_k=20) - noise.log()
    assert torch.equal(generate.sample(scores.float(), noise, temperature=0.8, top_k=20), race.argmax(dim=-1))


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.randn(3, 50)
    probs = generate.logits_to_probs(logits, temperature=1.0, top_k=7)
    for row_logits, row_probs in zip(logits, probs):
        kept = set(row_probs.nonzero().flatten().tolist())
        assert kept == set(row_logits.topk(7).indices.tolist())
        assert row_probs.sum().item() == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("top_p, expected_kept", [(0.4, {2}), (0.7, {2, 0}), (0.8, {2, 0, 3}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_smallest_set_reaching_the_mass(top_p, expected_kept):
    # probabilities 0.25, 0.125, 0.5, 0.125 -> sorted: token 2 (0.5), 0 (0.25), then 1 and 3 (0.125 each)
    probs = torch.tensor([0.25, 0.125, 0.5, 0.125])
    # nudge token 3 above token 1 so that the order is unambiguous
    logits = probs.log() + torch.tensor([0.0, 0.0, 0.0, 1e-3])
    kept = set(generate.logits_to_probs(logits[None], 1.0, top_p=top_p)[0].nonzero().flatten().tolist())
    assert kept == expected_kept


def test_top_p_is_applied_after_top_k_and_temperature():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    # top-k 3 renormalises over the three best; at temperature 0.5 their masses are ~0.867, 0.117, 0.016
    probs = generate.logits_to_probs(logits, temperature=0.5, top_k=3, top_p=0.9)
    assert probs[0].nonzero().flatten().tolist() == [0, 1]
    expected = torch.softmax(torch.tensor([8.0, 6.0]), dim=0)
    assert torch.allclose(probs[0, :2], expected, atol=1e-6)


def test_exponential_race_draws_from_the_filtered_distribution():
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, -5.0]).expand(200_000, 5)
    target = generate.logits_to_probs(logits[:1], temperature=0.7, top_k=4)[0]
    noise = generate.draw_noise(200_000, 5, 0.7, torch.Generator().manual_seed(0), "cpu")
    tokens = generate.sample(logits, noise, temperature=0.7, top_k=4)
    frequencies = torch.bincount(tokens, minlength=5).double() / len(tokens)
    assert frequencies[4] == 0  # outside the top-k: never drawn
    assert torch.allclose(frequencies, target.double(), atol=4e-3)


def test_fixed_seed_reproduces_and_seeds_differ():
    model, prompts = tiny_model(), [random_prompt(6, 1), random_prompt(4, 2)]
    kwargs = dict(temperature=1.0, top_k=20, top_p=0.95)
    first = generate.generate(model, prompts, 12, seed=1234, **kwargs).sequences
    again = generate.generate(model, prompts, 12, seed=1234, **kwargs).sequences
    other = generate.generate(model, prompts, 12, seed=99, **kwargs).sequences
    with_generator = generate.generate(model, prompts, 12, generator=torch.Generator().manual_seed(1234), **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert all(torch.equal(a, b) for a, b in zip(first, with_generator.sequences))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))


# --- greedy decoding -----------------------------------------------------------------------


def reference_greedy(model: Transformer, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """float64, no incremental decoding: every token comes from a full forward over the whole sequence."""
    model = copy.deepcopy(model).double()
    model.setup_caches(1, len(prompt) + n)
    sequence = prompt.clone()
    with torch.no_grad():
        for _ in range(n):
            logits = model(sequence[None], torch.arange(len(sequence)))
            sequence = torch.cat([sequence, logits[0, -1].argmax()[None]])
    return sequence


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_greedy_matches_float64_full_sequence_reference(kind):
    model, prompt = tiny_model(kind), random_prompt(7, 3)
    result = generate.generate(model, [prompt], 16)
    assert result.prompt_lengths == [7]
    assert torch.equal(result.sequences[0], reference_greedy(model, prompt, 16))
    assert torch.equal(result.new_tokens[0], result.sequences[0][7:])
    assert result.decode_steps == 15 and len(result.step_times_s) == 15


# --- the decode-attention plug --------------------------------------------------------------

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(INTERPRETING, reason="checks the CPU without the interpreter")
def test_no_decode_attention_plug_on_the_cpu_without_the_interpreter():
    """The plug's other tests run the Triton kernel on CPU under TRITON_INTERPRET=1 (marked
    `interpreted`: tests/interpreted_tests.py); without it nothing is plugged in."""
    model = tiny_model()
    assert not generate.install_decode_attention(model)
    assert all(layer.attention.decode_attention is None for layer in model.layers)


@interpreted
@pytest.mark.parametrize("qk_norm", [False, True])  # Llama; Qwen3 (its q/k norms in the kernel)
@torch.no_grad()
def test_plug_decodes_the_logits_of_plain_pytorch(qk_norm):
    torch.manual_seed(0)
    model = Transformer(ModelArgs(block_size=64, vocab_size=48, n_layer=2, n_head=4, n_local_heads=2, dim=64,
                                  intermediate_size=48, qk_norm=qk_norm)).eval()  # head_dim 16: the kernel's least
    plain = copy.deepcopy(model)
    for m in (model, plain):
        m.setup_caches(2, 40)
        m.set_left_padding(torch.tensor([0, 3]))
    assert generate.install_decode_attention(model)
    assert all(layer.attention.decode_attention is not None for layer in model.layers)
    assert all(layer.attention.decode_attention is None for layer in plain.layers)
    calls = []  # the decode steps' calls of the plug, one a layer and step
    for layer in model.layers:
        kernel = layer.attention.decode_attention
        layer.attention.decode_attention = lambda *args, kernel=kernel: calls.append(1) or kernel(*args)
    prompt = torch.randint(0, 48, (2, 9))
    torch.testing.assert_close(model(prompt, torch.arange(9)), plain(prompt, torch.arange(9)))  # the prefill: SDPA
    for position in range(9, 13):
        token = torch.randint(0, 48, (2, 1))
        at = torch.tensor([position])
        torch.testing.assert_close(model(token, at), plain(token, at), atol=1e-4, rtol=1e-4)
    assert len(calls) == 2 * 4
    for ours, theirs in zip(model.layers, plain.layers):  # the plug wrote the same cache slots
        torch.testing.assert_close(ours.attention.kv_cache.k_cache, theirs.attention.kv_cache.k_cache)
        torch.testing.assert_close(ours.attention.kv_cache.v_cache, theirs.attention.kv_cache.v_cache)


@interpreted
def test_plug_is_not_installed_for_a_head_dim_the_kernel_does_not_support():
    model = tiny_model("qwen3")  # head_dim 12
    assert not generate.install_decode_attention(model)
    assert all(layer.attention.decode_attention is None for layer in model.layers)


def gemv_as_inductor_decomposes_it_on_the_gpu(a, b, out_dtype=None):
    """aten.mm as torch's Inductor lowers a one-row product on CUDA under coordinate-descent
    tuning: an fp32 multiply-and-sum, then a cast back (torch/_inductor/decomposition.py, mm)."""
    return (a.float().unsqueeze(2) * b.float().unsqueeze(0)).sum(dim=1).to(a.dtype)


@interpreted
@pytest.mark.parametrize("gemv_as_on_the_gpu,qk_norm", [(False, False), (True, False), (False, True)])
def test_compiled_decode_step_hands_the_plug_whole_buffers(gemv_as_on_the_gpu, qk_norm, monkeypatch):
    # The compiled decode step around the kernels (on CPU: Inductor's C++ code, the kernels under
    # the interpreter) must give the fused attention whole buffers: Inductor copies each row or
    # slice made in the step into a fresh buffer for each layer's call: per-step cos/sin and mask
    # rows, or q, k, v as three slices of the dense GEMV's output (fp32 sums cast to bf16, as the
    # GPU lowers a one-row product; emulated here), each cost launches a step. Its logits must match
    # the same model on SDPA, with a left-padded row, also with Qwen3's q/k norms (in the kernel).
    # In fp32, but bf16 where the GPU's lowering is emulated: its cast is to bf16.
    import contextlib
    import re

    from torch._inductor import decomposition
    from torch._inductor.utils import run_and_get_code

    if gemv_as_on_the_gpu:
        for table in (decomposition.decompositions, decomposition.fast_random_decomps()):
            monkeypatch.setitem(table, torch.ops.aten.mm.default, gemv_as_inductor_decomposes_it_on_the_gpu)
    torch.manual_seed(0)
    model = Transformer(ModelArgs(block_size=128, vocab_size=64, n_layer=3, n_head=8, n_local_heads=2, dim=256,
                                  intermediate_size=128, qk_norm=qk_norm)).eval()
    if gemv_as_on_the_gpu:
        model = model.to(torch.bfloat16)
    model.setup_caches(2, 64)
    model.set_left_padding(torch.tensor([0, 3]))
    token, position = torch.randint(0, 64, (2, 1)), torch.tensor([9])
    with torch.no_grad():
        model(torch.randint(0, 64, (2, 9)), torch.arange(9))  # the prompt, through SDPA (CPU)
        reference = model(token, position)  # SDPA; the fused kernel writes the same slot again below
        assert generate.install_decode_attention(model)
        # (a cached graph of another case would not know the decomposition changed)
        with (torch._inductor.config.patch(fx_graph_cache=False) if gemv_as_on_the_gpu else contextlib.nullcontext()):
            logits, codes = run_and_get_code(torch.compile(model), token, position)
    assert relative_error(logits, reference) < (2e-2 if gemv_as_on_the_gpu else 1e-4)
    code = "\n".join(codes)
    calls = re.findall(r"sparse_decoding\.decode_attention_with_cache_write\.default\((.*)\)$", code, re.M)
    assert len(calls) == 3, calls
    assert ("extern_kernels.mm(" in code) != gemv_as_on_the_gpu  # the emulation took
    for call in calls:
        # the heads: the projection's output whole (a buffer, or a view of all of it); then the
        # tables, the padding, the new token's slot, the caches (and the norms' weights): each an
        # input of the graph
        arguments = re.sub(r"reinterpret_tensor\((buf\d+), \([^)]*\), \([^)]*\), 0\)", r"\1", call).split(", ")
        arguments = [re.sub(r"^\w+=", "", a) for a in arguments]  # keyword arguments by value
        assert re.fullmatch(r"buf\d+", arguments[0]), call
        assert all(re.fullmatch(r"arg\d+_1", a) for a in arguments[1:7 + 2 * qk_norm]), call
        norm_eps = arguments[9:] if qk_norm else arguments[7:]
        assert norm_eps == ["1e-05"] if qk_norm else norm_eps in ([], ["None", "None", "0.0"]), call
        # ... written whole by one kernel (the GEMV's, with its cast): not in slices, each of which
        # the GPU writes with a kernel of its own
        writer = rf"^\s*(cpp_fused\w*|extern_kernels\.\w+)\(.*\b{arguments[0]}\b"
        assert re.search(writer, code, re.M), f"{arguments[0]} is written in slices"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("qk_norm", [False, True])  # Llama; Qwen3 (its q/k norms in the kernel)
def test_gpu_plug_decodes_as_sdpa(qk_norm, monkeypatch):
    from sparse.kernels import decode_attention

    # A model whose decode steps go through the kernel, against the same model on SDPA, with a
    # batch of prompts of different lengths (left padding), eagerly and compiled (through CUDA
    # graphs).

    torch.manual_seed(0)
    model = Transformer(ModelArgs(block_size=128, vocab_size=64, n_layer=2, n_head=8, n_local_heads=2, dim=512,
                                  intermediate_size=256, qk_norm=qk_norm)).cuda().eval()
    prompts = [torch.randint(0, 64, (n,)) for n in (5, 17)]
    # No counters held yet, as in a fresh process, and the compiled run first with the plug: only
    # install_decode_attention (generate calls it after setup_caches) may reserve them; counters
    # first made inside the CUDA-graph warm-up break cudagraph trees' memory-pool check.
    monkeypatch.setattr(decode_attention, "arrival_counters", {})
    with monkeypatch.context() as patch:
        patch.setattr(decode_attention, "supports", lambda head_dim: False)
        reference = generate.generate(model, prompts, 20)
    for compile in (True, False):
        result = generate.generate(model, prompts, 20, compile=compile)
        assert all(torch.equal(a, b) for a, b in zip(result.sequences, reference.sequences)), compile


def test_batch_of_different_lengths_equals_each_prompt_alone():
    model = tiny_model()
    prompts = [random_prompt(n, seed) for seed, n in enumerate([3, 11, 6, 1])]
    batched = generate.generate(model, prompts, 10)
    assert batched.prompt_lengths == [3, 11, 6, 1]
    for prompt, sequence in zip(prompts, batched.sequences):
        assert torch.equal(sequence, generate.generate(model, [prompt], 10).sequences[0])
        assert torch.equal(sequence[: len(prompt)], prompt)
    assert not model.left_pad.any()  # the model is left unpadded for plain forwards afterwards


def test_generation_is_cut_at_the_context_end():
    model = tiny_model()
    result = generate.generate(model, [random_prompt(60, 0)], 50)
    assert len(result.sequences[0]) == 64  # block_size
    with pytest.raises(ValueError, match="does not fit the model's context"):
        generate.generate(model, [random_prompt(64, 0)], 5)


# --- EOS ------------------------------------------------------------------------------------


def first_new_token_at(tokens: torch.Tensor, index: int) -> int:
    """A token that first occurs in `tokens` at or after `index` (so it cuts there)."""
    for i in range(index, len(tokens)):
        if tokens[i] not in tokens[:i]:
            return int(tokens[i])
    pytest.skip("greedy output repeats a single token; pick another seed")


def test_eos_stops_generation_and_cuts_each_row():
    model = tiny_model()
    prompts = [random_prompt(5, 10), random_prompt(8, 11)]
    free = generate.generate(model, prompts, 40)
    eos = first_new_token_at(free.new_tokens[0], 2)
    stopped = generate.generate(model, prompts, 40, eos_ids={eos})
    for row_free, row_stopped in zip(free.new_tokens, stopped.new_tokens):
        hits = (row_free == eos).nonzero().flatten().tolist()
        expected = row_free[: hits[0] + 1] if hits else row_free
        assert torch.equal(row_stopped, expected)
    assert stopped.new_tokens[0][-1] == eos


def test_eos_in_every_row_ends_the_loop_early():
    model = tiny_model()
    prompt = random_prompt(5, 10)
    free = generate.generate(model, [prompt], 40)
    eos = first_new_token_at(free.new_tokens[0], 1)
    stopped = generate.generate(model, [prompt, prompt], 40, eos_ids=[eos])
    assert stopped.decode_steps < 39  # stopped at the first EOS check after both rows ended
    assert stopped.decode_steps <= (free.new_tokens[0] == eos).nonzero()[0].item() + generate.EOS_CHECK_INTERVAL


def test_rows_leave_the_batch_at_their_eos_and_the_others_decode_as_alone(monkeypatch):
    """Greedy rows of different prompt lengths, ending at different steps: each equals its prompt
    generated alone, and every step after a row's EOS runs on fewer rows."""
    model = tiny_model()
    prompts = [random_prompt(n, seed) for seed, n in enumerate([3, 9, 6, 1, 12, 4])]
    free = generate.generate(model, prompts, 30)
    eos = first_new_token_at(free.new_tokens[0], 3)
    assert any(eos not in row for row in free.new_tokens), "pick another EOS: every row ends"
    rows_per_step = []
    step = generate.decode_one_token
    monkeypatch.setattr(generate, "decode_one_token",
                        lambda model, token, *args, **kw: rows_per_step.append(len(token)) or step(model, token, *args, **kw))
    batched = generate.generate(model, prompts, 30, eos_ids=[eos])
    monkeypatch.undo()
    for prompt, row in zip(prompts, batched.new_tokens):
        assert torch.equal(row, generate.generate(model, [prompt], 30, eos_ids=[eos]).new_tokens[0])
    ends = sorted(len(row) for row in batched.new_tokens if row[-1] == eos)
    assert rows_per_step[0] == len(prompts) and rows_per_step == sorted(rows_per_step, reverse=True)
    # A row whose EOS came from step s (new token s) is gone from step s + 1 on.
    assert rows_per_step[-1] == len(prompts) - len(ends)
    assert rows_per_step[ends[0]] == len(prompts) - sum(end == ends[0] for end in ends)
    assert not model.left_pad.any()


def test_a_sampled_row_draws_the_same_tokens_whether_or_not_others_left_the_batch():
    model = tiny_model()
    prompts = [random_prompt(n, 20 + n) for n in (4, 7, 2)]
    sampling = dict(temperature=1.0, top_k=None, seed=3)
    free = generate.generate(model, prompts, 25, **sampling)
    eos = first_new_token_at(free.new_tokens[1], 2)
    stopped = generate.generate(model, prompts, 25, eos_ids=[eos], **sampling)
    for row_free, row_stopped in zip(free.new_tokens, stopped.new_tokens):
        hits = (row_free == eos).nonzero().flatten().tolist()
        assert torch.equal(row_stopped, row_free[: hits[0] + 1] if hits else row_free)


# --- loading and bytes per step ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_load_model_round_trips_a_checkpoint(tmp_path, kind):
    model = tiny_model(kind)
    save_checkpoint(tmp_path / "model.pth", model.state_dict(), model.config)
    loaded = generate.load_model(tmp_path / "model.pth", "cpu", torch.float32)
    if model.config.tie_embeddings:
        assert loaded.output.weight is loaded.tok_embeddings.weight
    prompt = random_prompt(6, 5)
    assert torch.equal(generate.generate(loaded, [prompt], 8).sequences[0],
                       generate.generate(model, [prompt], 8).sequences[0])


def test_bytes_read_per_step_counts_weights_once_and_the_whole_cache():
    model = tiny_model("qwen3")  # tied: the lm_head is read in full, the embedding by rows
    model.setup_caches(2, 40)
    c = model.config
    linear = c.n_layer * c.dim * ((c.n_head + 2 * c.n_local_heads) * c.head_dim + 3 * c.intermediate_size) \
        + c.n_layer * c.n_head * c.head_dim * c.dim
    norms = c.n_layer * (2 * c.dim + 2 * c.head_dim) + c.dim
    expected_weights = 4 * (linear + norms + c.vocab_size * c.dim + 2 * c.dim)
    expected_cache = 4 * 2 * c.n_layer * 2 * c.n_local_heads * model.max_seq_length * c.head_dim
    assert generate.bytes_read_per_step(model, 2) == dict(
        weights=expected_weights, kv_cache=expected_cache, total=expected_weights + expected_cache)


def test_bytes_read_per_step_of_a_sparse_model_on_the_cpu_are_dense_sized():
    """On the CPU (no Triton interpreter) SparseLinear multiplies by its weight expanded to dense, so a
    step reads as many weight bytes as the dense model; where the kernels run, values + masks."""
    from sparse import swap_to_sparse

    torch.manual_seed(0)
    dense = Transformer(ModelArgs(**dict(TINY["llama"], intermediate_size=64))).eval()  # 64: whole mask words
    dense.setup_caches(1, 40)
    sparse_model = swap_to_sparse(copy.deepcopy(dense), "2:4")
    sparse_model.setup_caches(1, 40)
    assert generate.bytes_read_per_step(sparse_model, 1) == generate.bytes_read_per_step(dense, 1)
    layer = sparse_model.layers[0].attention.wqkv
    assert layer.runs_expanded == (not INTERPRETING)
    packed = layer.values.nbytes + layer.mask.nbytes
    assert layer.bytes_read_per_step() == (packed if INTERPRETING else layer.in_features * layer.out_features * 4)


def test_on_tokens_sees_the_ids_as_they_grow():
    model, seen = tiny_model(), []
    result = generate.generate(model, [random_prompt(5, 1)], 9, on_tokens=lambda ids: seen.append(ids.clone()))
    assert [ids.shape[1] for ids in seen] == list(range(1, 10)) + [9]  # prefill, each step, the end
    assert torch.equal(seen[-1][0], result.new_tokens[0])


def test_on_tokens_returning_true_stops_generation_with_the_same_prefix():
    model, prompt = tiny_model(), random_prompt(5, 1)
    full = generate.generate(model, [prompt], 12)
    cut = generate.generate(model, [prompt], 12, on_tokens=lambda ids: ids.shape[1] >= 4)
    assert cut.decode_steps == 3 and torch.equal(cut.new_tokens[0], full.new_tokens[0][:4])


# --- command line -----------------------------------------------------------------------------


def run_cli(*args):
    return subprocess.run([sys.executable, str(REPO / "generate.py"), "--device", "cpu", *map(str, args)],
                          capture_output=True, text=True, cwd=REPO)


def assert_one_error_line(result, *phrases):
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    for phrase in phrases:
        assert phrase in lines[0]


def test_cli_missing_checkpoint(tmp_path):
    assert_one_error_line(run_cli("--checkpoint", tmp_path / "nope.pth"), "not found")


def test_cli_corrupt_checkpoint(tmp_path):
    (tmp_path / "model.pth").write_bytes(bytes(range(256)) * 64)
    result = run_cli("--checkpoint_path", tmp_path / "model.pth")
    assert_one_error_line(result, f"not a checkpoint: {tmp_path / 'model.pth'}")
    assert result.returncode == 2


@pytest.mark.parametrize("flag, value, message", [
    ("--temperature", "-1", "must be >= 0"), ("--temperature", "nan", "must be finite"),
    ("--top_p", "0", "must be in (0, 1]"), ("--top_p", "-0.5", "must be in (0, 1]"),
    ("--top_k", "0", "must be >= 1 or 'off'"), ("--top_k", "-3", "must be >= 1 or 'off'"),
    ("--max_new_tokens", "0", "must be a positive integer"), ("--batch_size", "-1", "must be a positive integer"),
    ("--num_samples", "0", "must be a positive integer"), ("--device", "gpu", "expected cpu, cuda or cuda:N"),
])
def test_cli_refuses_bad_sampling_and_budgets_before_loading(flag, value, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(generate, "load_model", lambda *args: pytest.fail("loaded the checkpoint"))
    with pytest.raises(SystemExit) as exit_info:
        generate.main(["--checkpoint", str(tmp_path / "model.pth"), flag, value])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"error: argument {flag}: {message}" in lines[0], lines


def test_cli_bad_argument_is_one_line_and_exit_code_2():
    result = run_cli("--checkpoint", "model.pth", "--top_k", "0")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "generate.py: error: argument --top_k: must be >= 1 or 'off', got 0 (see --help)"]


@pytest.mark.parametrize("sampling, message", [
    (dict(temperature=-1.0), "temperature must be finite and >= 0"),
    (dict(temperature=float("nan")), "temperature must be finite and >= 0"),
    (dict(temperature=0.8, top_k=0), "top_k must be an integer >= 1"),
    (dict(temperature=0.8, top_k=2.5), "top_k must be an integer >= 1"),
    (dict(temperature=0.8, top_p=0.0), "top_p must be in (0, 1]"),
    (dict(temperature=0.8, top_p=1.5), "top_p must be in (0, 1]"),
])
def test_python_api_refuses_bad_sampling_before_any_step(sampling, message):
    model = tiny_model()
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("]", r"\]")):
        generate.generate(model, [random_prompt(4, 0)], 2, **sampling)
    assert not hasattr(model.layers[0].attention, "kv_cache") or model.layers[0].attention.kv_cache is None


def test_cli_top_k_off_means_no_top_k_cut():
    assert generate.parse_args(["--checkpoint", "m.pth", "--top_k", "off"]).top_k is None


@pytest.fixture
def tiny_checkpoint_with_tokenizer(tmp_path):
    """A tiny random model plus a word-level tokenizer.json beside it (vocab = the model's)."""
    pytest.importorskip("tokenizer", reason="tokenizer.py is not in the repo yet")
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(TINY["llama"]["vocab_size"] - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    model = tiny_model()
    save_checkpoint(tmp_path / "model.pth", model.state_dict(), model.config)
    return tmp_path / "model.pth"


def test_cli_prompt_longer_than_context(tiny_checkpoint_with_tokenizer):
    prompt = " ".join(["w1"] * 80)  # block_size is 64
    result = run_cli("--checkpoint", tiny_checkpoint_with_tokenizer, "--prompt", prompt)
    assert_one_error_line(result, "context")


def test_cli_takes_a_folder_holding_one_checkpoint_and_streams_after_the_prompt(tiny_checkpoint_with_tokenizer):
    result = run_cli("--checkpoint", tiny_checkpoint_with_tokenizer.parent, "--prompt", "w1 w2 w3",
                     "--max_new_tokens", 6, "--temperature", 0)
    assert result.returncode == 0, result.stderr
    assert f"Loaded {tiny_checkpoint_with_tokenizer} " in result.stdout
    model = generate.load_model(tiny_checkpoint_with_tokenizer, "cpu", torch.float32)
    from tokenizer import load_tokenizer
    tokenizer = load_tokenizer(tiny_checkpoint_with_tokenizer.parent)
    ids = generate.generate(model, [torch.tensor(tokenizer.encode("w1 w2 w3", bos=True))], 6).new_tokens[0]
    assert "w1 w2 w3" + tokenizer.decode(ids.tolist()) in result.stdout  # the prompt echoed, then the text


def test_cli_folder_with_several_checkpoints_lists_them(tiny_checkpoint_with_tokenizer):
    folder = tiny_checkpoint_with_tokenizer.parent
    (folder / "pruned-2of4.pth").write_bytes(tiny_checkpoint_with_tokenizer.read_bytes())
    result = run_cli("--checkpoint", folder)
    assert_one_error_line(result, "holds 2 checkpoints (model.pth, pruned-2of4.pth)")
    assert result.returncode == 2


def test_cli_folder_without_a_checkpoint(tmp_path):
    result = run_cli("--checkpoint", tmp_path)
    assert_one_error_line(result, "no checkpoint (.pth) in the folder")
    assert result.returncode == 2


def test_cli_generates_and_reports_speed(tiny_checkpoint_with_tokenizer):
    result = run_cli("--checkpoint", tiny_checkpoint_with_tokenizer, "--prompt", "w1 w2 w3", "--max_new_tokens", 6,
                     "--batch_size", 2, "--seed", 0)
    assert result.returncode == 0, result.stderr
    for phrase in ("tok/s", "GB/s", "peak memory"):
        assert phrase in result.stdout


# --- compile ----------------------------------------------------------------------------------


def test_compiled_passes_inductor_options_to_its_compile_only(monkeypatch):
    """Our Inductor options ride on the torch.compile call (with the mode's own options, since
    torch.compile takes one or the other); the process-wide Inductor config stays untouched."""
    import torch._inductor.config as inductor_config
    before = inductor_config.get_config_copy()
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    monkeypatch.setattr(generate, "_compiled_functions", {})
    step = generate.compiled(generate.decode_one_token, mode="reduce-overhead", fullgraph=True, dynamic=False)
    assert generate.compiled(generate.decode_one_token, mode="reduce-overhead", fullgraph=True, dynamic=False) is step
    generate.compiled(generate.prefill, fullgraph=True, dynamic=True)
    reduce_overhead = {"triton.cudagraphs": True, **generate.INDUCTOR_OPTIONS}
    assert calls == [dict(options=reduce_overhead, fullgraph=True, dynamic=False),
                     dict(options=generate.INDUCTOR_OPTIONS, fullgraph=True, dynamic=True)]
    assert inductor_config.get_config_copy() == before


def test_inductor_tuner_times_gpu_candidates_on_the_device_clock(monkeypatch, capsys):
    """tune_on_device_clock() wraps Inductor's bench() once, so GPU candidates take its profiler
    path (with_profiler) and CPU ones stay as they were; where the profiler path fails, a candidate
    falls back to the events with a warning; without the switch it warns and leaves Inductor alone."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    assert "with_profiler" in inspect.signature(CachingAutotuner.bench).parameters  # what it relies on
    timed_with_profiler = []

    def bench(self, launcher, *args, with_profiler=False, **kwargs):
        timed_with_profiler.append(with_profiler)
        return 1.0

    monkeypatch.setattr(CachingAutotuner, "bench", bench)
    assert generate.inductor_tuner_clock() == "events"
    generate.tune_on_device_clock()
    generate.tune_on_device_clock()  # idempotent: one wrapper around Inductor's bench
    assert CachingAutotuner.bench.__wrapped__ is bench
    assert generate.inductor_tuner_clock() == "device"  # what bench_decode.py records with each row
    on = {kind: SimpleNamespace(device_props=SimpleNamespace(type=kind)) for kind in ("cuda", "cpu")}
    assert CachingAutotuner.bench(on["cuda"], "launcher") == 1.0
    CachingAutotuner.bench(on["cpu"], "launcher")
    assert timed_with_profiler == [True, False]

    def profiler_fails(self, launcher, *args, with_profiler=False, **kwargs):
        if with_profiler:
            raise RuntimeError("Failed to capture device events for do_bench_using_profiling")
        return 2.0

    monkeypatch.setattr(CachingAutotuner, "bench", profiler_fails)
    generate.tune_on_device_clock()
    assert CachingAutotuner.bench(on["cuda"], "launcher") == 2.0  # back to the events, with a warning
    assert CachingAutotuner.bench(on["cuda"], "launcher") == 2.0
    assert capsys.readouterr().err.count("profiler-based timer failed") == 1  # once, not per candidate

    monkeypatch.setattr(CachingAutotuner, "bench", lambda self, launcher, *args, **kwargs: 1.0)
    old = CachingAutotuner.bench
    generate.tune_on_device_clock()
    assert CachingAutotuner.bench is old and "no with_profiler switch" in capsys.readouterr().err
    assert generate.inductor_tuner_clock() == "events"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_inductor_tuning_on_the_device_clock_compiles_and_runs(monkeypatch, tmp_path):
    """A GEMV compiled through generate.compiled() in a fresh Inductor cache is tuned through the
    profiler-based timer, and its result is right."""
    import torch._inductor.utils as inductor_utils
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(generate, "_compiled_functions", {})
    profiled = []
    timer = inductor_utils.do_bench_using_profiling
    monkeypatch.setattr(inductor_utils, "do_bench_using_profiling",
                        lambda fn, *args, **kwargs: profiled.append(fn) or timer(fn, *args, **kwargs))

    def gemv(weight, x):  # as a decode step has it: an RMSNorm, then the product (Inductor's kernels)
        x = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype)
        return torch.nn.functional.linear(x, weight)

    weight = torch.randn(3000, 1536, device="cuda", dtype=torch.bfloat16)  # a shape no other test compiles
    x = torch.randn(1, 1536, device="cuda", dtype=torch.bfloat16)
    y = generate.compiled(gemv, fullgraph=True, dynamic=False)(weight, x)
    normed = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    reference = normed @ weight.double().T
    assert (y.double() - reference).norm() / reference.norm() < 1e-2  # bf16 rounding: ~3e-3
    assert profiled, "Inductor tuned the GEMV without its profiler-based timer"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_cuda_decode_matches_eager():
    model = tiny_model().cuda()
    prompts = [random_prompt(5, 1), random_prompt(9, 2)]
    for sampling in (dict(), dict(temperature=0.8, top_k=10, top_p=0.9, seed=7)):
        eager = generate.generate(model, prompts, 24, **sampling)
        compiled = generate.generate(model, prompts, 24, compile=True, **sampling)
        assert all(torch.equal(a, b) for a, b in zip(eager.sequences, compiled.sequences))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_cuda_decode_of_a_sparse_model_matches_eager():
    # The SpMV kernel's split-K workspace must exist before the CUDA graph is recorded; a lazily
    # allocated one once landed in the graph's pool and cudagraph trees refused the step.
    import sparse

    torch.manual_seed(0)
    model = Transformer(ModelArgs(**dict(TINY["llama"], intermediate_size=64))).eval()  # in_features % 32 == 0
    model = sparse.swap_to_sparse(model, "2:4").cuda()
    prompts = [random_prompt(5, 1), random_prompt(9, 2)]
    eager = generate.generate(model, prompts, 24)
    compiled = generate.generate(model, prompts, 24, compile=True)
    assert all(torch.equal(a, b) for a, b in zip(eager.sequences, compiled.sequences))


def test_cli_prompts_file_is_one_batch(tiny_checkpoint_with_tokenizer, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w1 w2 w3\n\nw4 w5 w6 w7 w8 w9\n")  # blank lines are skipped
    result = run_cli("--checkpoint", tiny_checkpoint_with_tokenizer, "--prompts_file", prompts,
                     "--max_new_tokens", 4, "--temperature", 0)
    assert result.returncode == 0, result.stderr
    assert "over 2 rows" in result.stdout


def test_cli_interactive_needs_a_chat_template(tiny_checkpoint_with_tokenizer):
    assert_one_error_line(run_cli("--checkpoint", tiny_checkpoint_with_tokenizer, "--interactive"), "chat template")


def test_cli_interactive_chat_with_smollm2(smollm2_checkpoint):
    result = subprocess.run([sys.executable, str(REPO / "generate.py"), "--device", "cpu", "--checkpoint",
                             str(smollm2_checkpoint), "--interactive", "--temperature", "0", "--max_new_tokens", "12"],
                            input="What is the capital of France?\nAnd of Italy?\n", capture_output=True, text=True,
                            cwd=REPO)
    assert result.returncode == 0, result.stderr
    replies = [line for line in result.stdout.splitlines() if "assistant>" in line]  # after the "you> " prompt
    assert len(replies) == 2 and "Paris" in replies[0]


def test_cli_empty_prompt_starts_from_bos_on_smollm2(smollm2_checkpoint):
    # SmolLM2's prompts carry no BOS, so "" encodes to nothing; generation must still start.
    result = run_cli("--checkpoint", smollm2_checkpoint, "--prompt", "", "--max_new_tokens", 4, "--temperature", 0)
    assert result.returncode == 0, result.stderr
    assert "decode: 3 steps" in result.stdout
