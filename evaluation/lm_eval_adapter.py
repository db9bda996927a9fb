"""lm-evaluation-harness on our engine: an `lm_eval` model class backed by generate.py, and its CLI.

    python -m evaluation.lm_eval_adapter --checkpoint pruned.pth --tasks boolq,rte,hellaswag,winogrande,arc_easy,arc_challenge,openbookqa --device cuda

`SparseDecodingLM` (registered with lm-eval as "sparsedecoding") loads a dense or packed-sparse
checkpoint with generate.load_model and answers the harness's three request types the way its own
Hugging Face model (`hf`) does, so scores compare across the two:
- loglikelihood: context and continuation are tokenized together and split (TemplateLM), scored in
  batches of right-padded sequences (a causal model never looks at the padding after a row);
- loglikelihood_rolling: the text in the harness's own disjoint windows of the model's context;
- generate_until: batched greedy (or sampled) generation through generate.generate, cut at the
  first stop sequence.
On CUDA the scoring forward and the decode step are compiled (generate.compiled).
"""
from pathlib import Path

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

import cli_args
from convert.writer import DTYPES
from evaluation.generation import USER_ERRORS, forward_logits, load_model_and_tokenizer

# Scored sequences are padded to a multiple of this many tokens, so a compiled forward sees few shapes.
LENGTH_STEP = 16


@register_model("sparsedecoding")
class SparseDecodingLM(TemplateLM):
    def __init__(self, checkpoint, device="cpu", dtype=None, batch_size=8, max_gen_toks=256, compile=None,
                 seed=0):
        super().__init__()
        dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        dtype = dtype or (torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
        self.model, self.tokenizer = load_model_and_tokenizer(checkpoint, device, dtype)
        self.checkpoint = str(checkpoint)
        self._device = torch.device(device)
        self.batch_size = int(batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self.compile = self._device.type == "cuda" if compile is None else bool(compile)
        self.seed = seed

    @property
    def device(self):
        return self._device

    @property
    def max_length(self) -> int:
        return self.model.config.block_size

    @property
    def eot_token_id(self) -> int:
        """The tokenizer's EOS (the lowest id where a chat model has several)."""
        return min(self.tokenizer.eos_ids)

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is conditioned on: BOS where the tokenizer has one, else EOS (as `hf`)."""
        return self.tokenizer.bos_id if self.tokenizer.bos_id is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return self.checkpoint

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        """add_special_tokens None: BOS as the tokenizer itself adds it, unless the text starts with it."""
        bos = self.tokenizer.add_bos if add_special_tokens is None else add_special_tokens
        if add_special_tokens is None and self.tokenizer.bos_id is not None and \
                string.startswith(self.tokenizer.decode([self.tokenizer.bos_id])):
            bos = False
        return self.tokenizer.encode(string, bos=bool(bos))

    def tok_decode(self, ids) -> str:
        return self.tokenizer.decode([t for t in ids if t not in self.tokenizer.eos_ids])

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: (cache key, context ids, continuation ids) -> (sum of log p(continuation), greedy?)."""
        def longest_first(request):
            tokens = request[1] + request[2]
            return -len(tokens), tuple(tokens)

        collator = Collator(requests, sort_fn=longest_first)
        results = []
        progress = tqdm(total=len(requests), desc="loglikelihood", disable=disable_tqdm)
        for batch in collator.get_batched(n=self.batch_size):
            rows = [(context + continuation)[-(self.max_length + 1):] for _, context, continuation in batch]
            width = -(-max(len(r) - 1 for r in rows) // LENGTH_STEP) * LENGTH_STEP
            idx = torch.zeros(len(rows), min(width, self.max_length), dtype=torch.long)
            for i, row in enumerate(rows):
                idx[i, :len(row) - 1] = torch.tensor(row[:-1])
            logits = forward_logits(self.model, idx, compile=self.compile)
            for i, ((key, _, continuation), row) in enumerate(zip(batch, rows)):
                n = len(continuation)  # only the continuation's positions are normalised and brought back
                scores = F.log_softmax(logits[i, len(row) - 1 - n:len(row) - 1], dim=-1).cpu()
                target = torch.tensor(row[-n:])
                answer = (float(scores.gather(-1, target[:, None]).sum()), bool((scores.argmax(-1) == target).all()))
                results.append(answer)
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
                progress.update(1)
        progress.close()
        return collator.get_original(results)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        totals = []
        for request in tqdm(requests, desc="loglikelihood_rolling", disable=disable_tqdm):
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(request.args[0]), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            scores = self._loglikelihood_tokens([(None, context, target) for context, target in windows],
                                                disable_tqdm=True)
            totals.append(sum(score for score, _ in scores))
            self.cache_hook.add_partial("loglikelihood_rolling", (request.args[0],), totals[-1])
        return totals

    def every_row_stopped(self, ids: torch.Tensor, until: list[str]) -> bool:
        """generate()'s on_tokens: stop once each row has ended or holds one of its stop strings (the text
        after it is cut anyway, and the ids before it do not depend on how long generation runs)."""
        eos = set(self.tokenizer.eos_ids)
        return all(eos.intersection(row) or any(stop in self.tok_decode(row) for stop in until)
                   for row in ids.tolist())

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        import generate

        eos_text = self.tokenizer.decode([self.eot_token_id])
        results = [None] * len(requests)
        by_settings = {}
        for i, request in enumerate(requests):
            context, gen_kwargs = request.args
            by_settings.setdefault(repr(sorted(gen_kwargs.items())), []).append((i, context, gen_kwargs))
        progress = tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm)
        for group in by_settings.values():
            settings = normalize_gen_kwargs(group[0][2], self.max_gen_toks)
            until = handle_stop_sequences(settings.pop("until", None), eos=eos_text)
            max_new = settings["max_gen_toks"]
            sampling = dict(temperature=settings.get("temperature", 0.0) if settings.get("do_sample") else 0.0,
                            top_k=settings.get("top_k"), top_p=settings.get("top_p"))
            for start in range(0, len(group), self.batch_size):
                batch = group[start:start + self.batch_size]
                # An empty context starts from the prefix token, as an empty loglikelihood context does.
                prompts = [self.tok_encode(context)[-(self.max_length - max_new):] or [self.prefix_token_id]
                           for _, context, _ in batch]
                out = generate.generate(self.model, [torch.tensor(p) for p in prompts], max_new,
                                        eos_ids=tuple(self.tokenizer.eos_ids), seed=self.seed,
                                        compile=self.compile, compile_prefill=self.compile,
                                        on_tokens=lambda ids: self.every_row_stopped(ids, until), **sampling)
                for (i, context, gen_kwargs), new in zip(batch, out.new_tokens):
                    text = self.tok_decode(new.tolist())
                    for stop in until:
                        text = text.split(stop)[0]
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
                    progress.update(1)
        progress.close()
        return results


def evaluate(checkpoint, tasks: list[str], *, device="cpu", dtype=None, batch_size=8, num_fewshot=None,
             limit=None, include_path=None, compile=None, log_samples=False) -> dict:
    """lm_eval.simple_evaluate with our engine as the model; returns the harness's results dict."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    task_manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in task_manager.all_tasks]
    if unknown:
        raise ValueError(f"unknown lm-eval task '{unknown[0]}' (lm-eval {lm_eval.__version__} lists "
                         f"{len(task_manager.all_tasks)}; --include_path adds a folder of task YAMLs)")
    try:  # the datasets first, so an offline machine hears it before the model is loaded
        task_manager.load(tasks)
    except ConnectionError as e:
        raise ValueError(f"cannot fetch the datasets of {','.join(tasks)} ({str(e).strip().splitlines()[0]}); "
                         f"lm-eval needs the Hugging Face hub once for each task, or --include_path with local "
                         f"data") from None
    model = SparseDecodingLM(checkpoint, device=device, dtype=dtype, batch_size=batch_size, compile=compile)
    return lm_eval.simple_evaluate(model=model, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                   task_manager=task_manager, log_samples=log_samples)


def main(argv=None):
    parser = cli_args.ArgumentParser(description="Score a checkpoint (dense or packed) on lm-evaluation-harness tasks.")
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task or group names")
    parser.add_argument("--device", type=cli_args.device, default="cpu")
    parser.add_argument("--dtype", choices=DTYPES, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--batch_size", type=cli_args.positive_int, default=8)
    parser.add_argument("--num_fewshot", type=cli_args.non_negative_int)
    parser.add_argument("--limit", type=cli_args.positive_int, help="first N documents of each task")
    parser.add_argument("--include_path", help="a folder of extra task YAMLs")
    parser.add_argument("--no_compile", action="store_true", help="on CUDA, run eagerly")
    parser.add_argument("--out", help="write lm-eval's results (with the config it ran) as JSON")
    args = parser.parse_args(argv)
    if not args.checkpoint.is_file():
        cli_args.exit_with_error(f"checkpoint not found: {args.checkpoint}")
    if args.include_path and not Path(args.include_path).is_dir():
        cli_args.exit_with_error(f"--include_path {args.include_path} is not a folder")
    try:
        results = evaluate(args.checkpoint, [t.strip() for t in args.tasks.split(",") if t.strip()],
                           device=args.device, dtype=args.dtype, batch_size=args.batch_size,
                           num_fewshot=args.num_fewshot, limit=args.limit, include_path=args.include_path,
                           compile=False if args.no_compile else None)
    except USER_ERRORS as e:
        cli_args.exit_with_error(e)
    from lm_eval.utils import make_table

    print(make_table(results))
    if args.out:
        from evaluation.data import write_json_atomic
        import json
        kept = {k: results[k] for k in ("results", "versions", "n-shot", "config") if k in results}
        write_json_atomic(args.out, json.loads(json.dumps(kept, default=str)))  # the config holds objects


if __name__ == "__main__":
    main()
