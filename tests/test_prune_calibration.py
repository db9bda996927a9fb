"""Calibration sources and statistics: text windows, prompt files, H accumulation, the
decoding-aware set checked against the layer inputs of a real KV-cached decode, and the positions
and mix of every source against hand-computed ones."""
import json

import pytest
import torch

from generate import generate
from model import ModelArgs, Transformer
from prune.calibration import (SOURCES, CalibrationError, CalibrationSet, InputStatistics, decode_calibration,
                               from_decode, generation_calibration, prompt_digest, prompt_file_record,
                               read_prompt_rows, read_prompts, reference_calibration, text_windows)
from prune.run import BlockReplay


class ByteTokenizer:
    """One token per UTF-8 byte (folded into a small vocabulary past BOS=1): enough to test what
    calibration does with token ids."""
    bos_id, eos_ids, chat_template = 1, set(), None

    def encode(self, text, bos=False):
        return ([self.bos_id] if bos else []) + [b % 90 + 2 for b in text.encode()]


def test_text_windows_are_seeded_non_overlapping_and_all_counted(tmp_path):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(30)))
    calibration = text_windows(ByteTokenizer(), corpus, n_tokens=1000, window_len=128, seed=5)
    assert len(calibration.sequences) == 8  # ceil(1000 / 128)
    assert all(len(s) == 128 for s in calibration.sequences)
    assert all(c.all() for c in calibration.counted) and calibration.counted_tokens == 8 * 128
    again = text_windows(ByteTokenizer(), corpus, n_tokens=1000, window_len=128, seed=5)
    other = text_windows(ByteTokenizer(), corpus, n_tokens=1000, window_len=128, seed=6)
    assert all(torch.equal(a, b) for a, b in zip(calibration.sequences, again.sequences))
    assert not all(torch.equal(a, b) for a, b in zip(calibration.sequences, other.sequences))
    assert calibration.info["kind"] == "text"
    assert calibration.mix() == {"counted_tokens": 1024, "domains": {"docs": {"tokens": 1024, "prompt_tokens": 0}}}
    with pytest.raises(CalibrationError, match="fewer than"):
        text_windows(ByteTokenizer(), corpus, n_tokens=10**6, window_len=128, seed=0)


def test_prompt_files(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a"}\n{"input": "b"}\n\n{"text": "c", "code": "x"}\n')
    assert read_prompts(jsonl) == ["a", "b", "c"]
    txt = tmp_path / "p.txt"
    txt.write_text("first\n\nsecond\n")
    assert read_prompts(txt) == ["first", "second"]
    jsonl.write_text('{"prompt": "a"}\n{"question": "b"}\n')
    with pytest.raises(CalibrationError, match=":2 has none of the fields"):
        read_prompts(jsonl)
    with pytest.raises(CalibrationError, match="not found"):
        read_prompts(tmp_path / "missing.jsonl")


def test_prompt_rows_carry_domain_and_reference(tmp_path):
    jsonl = tmp_path / "mixed.jsonl"
    jsonl.write_text('{"prompt": "essay", "domain": "writing"}\n{"text": "add two", "code": "def f(a, b): ..."}\n'
                     '{"prompt": "q", "domain": "code", "reference": "r"}\n')
    assert read_prompt_rows(jsonl) == [dict(prompt="essay", domain="writing", reference=None),
                                       dict(prompt="add two", domain="mixed", reference="def f(a, b): ..."),
                                       dict(prompt="q", domain="code", reference="r")]
    txt = tmp_path / "lines.txt"
    txt.write_text("one\ntwo\n")
    assert [row["domain"] for row in read_prompt_rows(txt)] == ["lines", "lines"]
    record = prompt_file_record(jsonl, read_prompt_rows(jsonl))
    assert record["prompt_sha256"][0] == prompt_digest("  essay\n") != prompt_digest("Essay")


def test_input_statistics_accumulate_only_counted_positions():
    torch.manual_seed(0)
    xs = [torch.randn(3, 7, 16) for _ in range(4)]
    counted = [torch.rand(3, 7) < 0.6 for _ in range(4)]
    stats = InputStatistics(16, dtype=torch.float64)
    for x, c in zip(xs, counted):
        stats.add(x, c)
    X = torch.cat([x[c] for x, c in zip(xs, counted)]).double()  # [n, 16]
    torch.testing.assert_close(stats.hessian, 2 * X.T @ X / X.shape[0])
    torch.testing.assert_close(stats.squared_norms, (X * X).sum(0))
    assert stats.n_tokens == X.shape[0]


def test_padded_batches_respect_the_token_budget():
    sequences = [torch.arange(n) for n in (5, 9, 3, 12, 7)]
    calibration = CalibrationSet(sequences, [torch.ones(n, dtype=torch.bool) for n in (5, 9, 3, 12, 7)])
    batches = calibration.padded_batches(max_tokens=20)
    assert sum(int(c.sum()) for _, c in batches) == calibration.counted_tokens
    assert all(t.numel() <= 20 or t.shape[0] == 1 for t, _ in batches)
    rows = sorted(tuple(t[c].tolist()) for t, c in batches for t, c in zip(*[t, c]))
    assert rows == sorted(tuple(s.tolist()) for s in sequences)


HUGE_PROMPT_TOKEN, SPIKE = 7, 5  # the prompt token's embedding: one huge coordinate


def tiny_model():
    torch.manual_seed(0)
    config = ModelArgs(block_size=128, vocab_size=96, n_layer=3, n_head=4, n_local_heads=2, dim=32,
                       intermediate_size=64)
    model = Transformer(config).eval()
    with torch.no_grad():
        # RMSNorm rescales every token to the same norm, so a huge embedding only dominates the
        # layer inputs if it is concentrated: all of it in one coordinate, which then carries
        # ~dim times its usual share of the statistics at the prompt's positions.
        model.tok_embeddings.weight[HUGE_PROMPT_TOKEN] = 0
        model.tok_embeddings.weight[HUGE_PROMPT_TOKEN, SPIKE] = 1000
    return model


def test_decode_statistics_match_a_kv_cached_decode_and_exclude_the_prompt():
    """Hook every layer's wqkv input during generate()'s KV-cached decode steps (the reference),
    then replay the calibration set teacher-forced: the H from decode positions must match, and
    including the huge-norm prompt positions would not."""
    pytest.importorskip("generate")
    model = tiny_model()
    prompts = [[HUGE_PROMPT_TOKEN] * 40 + [3, 4], [HUGE_PROMPT_TOKEN] * 25 + [5]]  # different lengths: left padding
    decode_stats = [InputStatistics(32, dtype=torch.float64) for _ in model.layers]
    hooks = [layer.attention.wqkv.register_forward_pre_hook(
                 lambda module, args, stats=stats: stats.add(args[0], torch.ones(args[0].shape[:2], dtype=torch.bool))
                 if args[0].shape[1] == 1 else None)  # T == 1: a decode step (prefill feeds the whole prompt)
             for layer, stats in zip(model.layers, decode_stats)]
    tokenizer = ByteTokenizer()
    tokenizer.encode = lambda text, bos=False: prompts[int(text)]
    max_new_tokens = 12
    calibration = decode_calibration(model, tokenizer, ["0", "1"], n_tokens=2 * (max_new_tokens - 1),
                                     max_new_tokens=max_new_tokens, temperature=0.0, batch_size=2)
    for hook in hooks:
        hook.remove()
    assert calibration.counted_tokens == 2 * (max_new_tokens - 1) == decode_stats[0].n_tokens
    for sequence, counted, prompt in zip(calibration.sequences, calibration.counted, prompts):
        assert torch.equal(sequence[:len(prompt)], torch.tensor(prompt))
        assert not counted[:len(prompt)].any() and counted[len(prompt):].all()

    batches = calibration.padded_batches(max_tokens=64)
    replay = BlockReplay(model.config, batches, torch.device("cpu"))
    all_positions = [(tokens, torch.ones_like(counted)) for tokens, counted in batches]
    x = [model.tok_embeddings(tokens).detach() for tokens, _ in batches]
    with_prompt_replay = BlockReplay(model.config, all_positions, torch.device("cpu"))
    for layer, reference in zip(model.layers, decode_stats):
        whole_block = lambda x: replay.feed_forward(layer, replay.attention(layer, x))  # noqa: E731
        replayed = InputStatistics(32, dtype=torch.float64)
        outputs = list(x)
        replay.run(layer, whole_block, outputs, {"attention.wqkv": replayed}, advance=True)
        scale = reference.hessian.abs().max()
        torch.testing.assert_close(replayed.hessian / scale, reference.hessian / scale, rtol=0, atol=1e-4)
        with_prompt = InputStatistics(32, dtype=torch.float64)
        with_prompt_replay.run(layer, whole_block, x, {"attention.wqkv": with_prompt})
        assert with_prompt.hessian[SPIKE, SPIKE] > 5 * reference.hessian[SPIKE, SPIKE]  # the prompt would dominate
        x = outputs


def test_first_positions_counted_on_request_only():
    calibration = CalibrationSet([torch.arange(6), torch.arange(4)],
                                 [torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.bool), torch.tensor([0, 0, 1, 1], dtype=torch.bool)],
                                 dict(kind="decode"))
    with_first = calibration.with_first_positions()
    assert [c.tolist() for c in with_first.counted] == [[1, 0, 0, 1, 1, 1], [1, 0, 1, 1]]
    assert with_first.counted_tokens == calibration.counted_tokens + 2 and with_first.info["first_position_counted"]
    assert not calibration.counted[0][0] and "first_position_counted" not in calibration.info  # a copy


def test_decode_budget_is_exact_and_cycles_prompts_with_sampling():
    pytest.importorskip("generate")
    model = tiny_model()
    calibration = decode_calibration(model, ByteTokenizer(), ["ab", "cde"], n_tokens=50, max_new_tokens=8,
                                     temperature=0.7, top_k=20, top_p=0.8, seed=1, batch_size=2)
    assert calibration.counted_tokens == 50  # 7 decode steps per sequence: 8 sequences, the last one cut
    assert len(calibration.sequences) == 8
    assert calibration.info["kind"] == "decode" and calibration.info["decode_tokens"] == 50
    first_round, second_round = calibration.sequences[:2], calibration.sequences[2:4]
    assert not all(torch.equal(a, b) for a, b in zip(first_round, second_round))  # fresh seeds each round


def test_decode_calibration_progress_moves_within_a_batch(monkeypatch):
    """The bar follows the decode steps of a batch as they run, and ends at the exact count."""
    import prune.calibration as calibration_module

    shown = []

    class RecordingBar:
        def __init__(self, total, **_):
            self.n, self.total = 0, total

        def update(self, n=1):
            self.n += n
            shown.append(self.n)

        def refresh(self):
            shown.append(self.n)

        def close(self):
            pass

    monkeypatch.setattr(calibration_module, "tqdm", RecordingBar)
    calibration = generation_calibration(tiny_model(), [torch.arange(2, 6)], n_tokens=30, max_new_tokens=16,
                                         batch_size=2)
    assert calibration.counted_tokens == 30 and shown[-1] == 30
    first_batch = [n for n in shown if n < 30]
    assert len(set(first_batch)) >= 10 and first_batch == sorted(first_batch)  # one batch of 2 x 15 steps


def test_compiled_generation_keeps_one_batch_shape(monkeypatch):
    """With compile=True every generate() call must see the same batch size, step count and
    KV-cache length (a new shape would recompile the CUDA-graphed step): short last batches are
    padded with rows that are dropped, the cache is sized once for the longest prompt, and the
    budget stays exact."""
    generate = pytest.importorskip("generate")
    model = tiny_model()
    real_generate, shapes = generate.generate, []

    def spy(model, prompts, max_new_tokens, **options):
        shapes.append((len(prompts), max_new_tokens, model.max_batch_size, model.max_seq_length))
        return real_generate(model, prompts, max_new_tokens, **dict(options, compile=False))

    monkeypatch.setattr(generate, "generate", spy)
    prompts = [torch.arange(2, 2 + n) for n in (3, 9, 5)]
    calibration = generation_calibration(model, prompts, n_tokens=40, max_new_tokens=8, batch_size=4, compile=True)
    assert calibration.counted_tokens == 40
    assert len(set(shapes)) == 1 and shapes[0][:3] == (4, 8, 4) and shapes[0][3] >= 9 + 8
    assert len(shapes) == 2  # 4 rows x 7 decode steps, then 12 more tokens from the same shape
    greedy = generation_calibration(model, prompts, n_tokens=100, max_new_tokens=8, temperature=0.0, batch_size=4,
                                    compile=True)
    assert greedy.counted_tokens == 3 * 7 and len(set(shapes)) == 1  # one pass; the padding row is dropped


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_statistics_from_bf16_inputs_match_float64():
    """The tensor-core path (bf16 x bf16 -> float32) on bf16 activations, outliers included, matches
    float64: the products are exact in float32, only the float32 sums round over thousands of rows,
    hence the bound of 1e-5. SparseGPT dampens H by 1% of its diagonal mean, far above this."""
    g = torch.Generator(device="cuda").manual_seed(0)
    xs = [torch.randn(4, 512, 1024, device="cuda", generator=g) for _ in range(3)]
    for x in xs:
        x[..., :4] *= 300  # LLM-like outlier channels
    xs = [x.bfloat16() for x in xs]
    counted = [torch.rand(4, 512, device="cuda", generator=g) < 0.7 for _ in xs]
    stats = InputStatistics(1024, device="cuda")
    for x, c in zip(xs, counted):
        stats.add(x, c)
    X = torch.cat([x[c] for x, c in zip(xs, counted)]).double()
    reference = 2 * X.T @ X / X.shape[0]
    assert stats.n_tokens == X.shape[0]
    assert ((stats.hessian.double() - reference).norm() / reference.norm()) < 1e-5


def hand_made_decode_set() -> CalibrationSet:
    """Two generated sequences as generation_calibration leaves them: prompt [11, 12, 13] + decode
    [21, 22, 23] (domain writing) and prompt [14, 15] + decode [24, 25] (domain code); 5 decode tokens."""
    return CalibrationSet([torch.tensor([11, 12, 13, 21, 22, 23]), torch.tensor([14, 15, 24, 25])],
                          [torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.bool), torch.tensor([0, 0, 1, 1], dtype=torch.bool)],
                          dict(kind="decode"), ["writing", "code"], [3, 2])


def counted_tokens(calibration: CalibrationSet) -> list:
    return [s[c].tolist() for s, c in zip(calibration.sequences, calibration.counted)]


def test_each_decode_source_counts_its_positions_of_the_same_sequences():
    decode = hand_made_decode_set()
    by_source = {source: from_decode(decode, source, n_tokens=5) for source in ("decode", "decode_first", "generated")}
    assert counted_tokens(by_source["decode"]) == [[21, 22, 23], [24, 25]]
    assert counted_tokens(by_source["decode_first"]) == [[11, 21, 22, 23], [14, 24, 25]]
    assert counted_tokens(by_source["generated"]) == [[11, 12, 13, 21, 22]]  # every position, cut at the budget
    for calibration in by_source.values():  # the very text of the decode set: a prefix of each sequence
        assert all(torch.equal(s, d[:len(s)]) for s, d in zip(calibration.sequences, decode.sequences))
    assert by_source["decode"].counted_tokens == by_source["generated"].counted_tokens == 5
    assert by_source["decode_first"].counted_tokens == 5 + 2  # one first position per sequence
    assert by_source["decode"].mix() == {"counted_tokens": 5, "domains": {
        "writing": {"tokens": 3, "prompt_tokens": 0}, "code": {"tokens": 2, "prompt_tokens": 0}}}
    assert by_source["decode_first"].mix()["domains"] == {"writing": {"tokens": 4, "prompt_tokens": 1},
                                                          "code": {"tokens": 3, "prompt_tokens": 1}}
    assert by_source["generated"].mix() == {"counted_tokens": 5, "domains": {"writing": {"tokens": 5, "prompt_tokens": 3}}}
    assert by_source["generated"].info["kind"] == "generated" and decode.info["kind"] == "decode"  # copies
    with pytest.raises(ValueError, match="not made from generations"):
        from_decode(decode, "reference", 5)
    assert set(SOURCES) == {"text", "reference", "decode", "decode_first", "generated"}


def test_reference_source_is_each_prompt_then_its_answer_every_position_counted():
    tokenizer = ByteTokenizer()  # no chat template: a prompt is BOS + its bytes
    rows = [dict(prompt="ab", domain="writing", reference=None), dict(prompt="cd", domain="code", reference="xyz"),
            dict(prompt="e", domain="code", reference="uvw")]
    calibration = reference_calibration(tokenizer, rows, n_tokens=10)
    byte = lambda text: [b % 90 + 2 for b in text.encode()]  # noqa: E731
    assert counted_tokens(calibration) == [[1, *byte("ab")], [1, *byte("cd"), *byte("xyz")], [1]]
    assert calibration.counted_tokens == 10 and all(c.all() for c in calibration.counted)
    assert calibration.mix() == {"counted_tokens": 10, "domains": {"writing": {"tokens": 3, "prompt_tokens": 3},
                                                                   "code": {"tokens": 7, "prompt_tokens": 4}}}
    assert calibration.info["kind"] == "reference" and calibration.info["references"] == 2
    with pytest.raises(CalibrationError, match="hold 14 tokens, fewer than the 15 asked for"):
        reference_calibration(tokenizer, rows, n_tokens=15)


def test_generated_sequences_are_labelled_with_their_prompts_domain():
    pytest.importorskip("generate")
    calibration = decode_calibration(tiny_model(), ByteTokenizer(), ["ab", "cde", "f"], n_tokens=40, max_new_tokens=6,
                                     domains=["writing", "code", "code"], seed=3, batch_size=2)
    for i, (domain, prompt_len) in enumerate(zip(calibration.domains, calibration.prompt_lengths, strict=True)):
        assert domain == ["writing", "code", "code"][i % 3] and prompt_len == [3, 4, 2][i % 3]
        assert not calibration.counted[i][:prompt_len].any() and calibration.counted[i][prompt_len:].all()
    mix = calibration.mix()
    assert mix["counted_tokens"] == 40 and sum(d["tokens"] for d in mix["domains"].values()) == 40


def test_decode_calibration_progress_never_counts_past_a_rows_eos(monkeypatch):
    """Rows that ended add nothing while the batch runs: the bar never goes back."""
    import prune.calibration as calibration_module

    shown = []

    class RecordingBar:
        def __init__(self, total, **_):
            self.n = 0

        def update(self, n=1):
            shown.append(self.n)

        def refresh(self):
            shown.append(self.n)

        def close(self):
            pass

        write = staticmethod(lambda text: None)

    monkeypatch.setattr(calibration_module, "tqdm", RecordingBar)
    model, prompts = tiny_model(), [torch.arange(2, 6), torch.arange(3, 9)]
    eos = generate(model, [prompts[0]], 3).new_tokens[0][1].item()  # the first row ends after 2 tokens
    calibration = generation_calibration(model, prompts, n_tokens=12, max_new_tokens=12, batch_size=2,
                                         eos_ids=(eos, ), temperature=0)
    assert shown == sorted(shown) and shown[-1] == calibration.counted_tokens
