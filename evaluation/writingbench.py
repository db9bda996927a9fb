"""WritingBench scoring with an LLM judge behind any OpenAI-compatible chat-completions endpoint.

WritingBench gives each query five criteria, each with a 1-10 rubric. The judge scores the reply
once per criterion and answers JSON {"score": s, "reason": ...}; a sample's score is the mean over
its criteria, the benchmark's score the mean over samples (1-10 scale).

The endpoint is whatever the user configures: --judge_url (a base URL such as
http://host:8000/v1, or the full .../chat/completions), --judge_model, and the API key from the
environment variable named by --judge_api_key_env (default JUDGE_API_KEY, then OPENAI_API_KEY).
Only urllib is used; requests are bounded (timeout, a few retries on 429/5xx/connection errors).

CLI: python -m evaluation.writingbench --checkpoint model.pth --judge_url http://127.0.0.1:8000/v1
         --judge_model NAME [--limit 10] [--max_new_tokens 1024] [--out wb.json]
"""
import argparse
import json
import os
import re
import time
import urllib.error
import urllib.request
from typing import Callable

from tqdm import tqdm

from evaluation.data import data_path, read_jsonl
from evaluation.generation import add_generation_args, load_generate_fn, run_cli

JUDGE_INSTRUCTIONS = """You are an expert evaluator of writing. Score the response to the writing request below on ONE criterion, using its rubric, on an integer scale of 1 to 10.

[Writing request]
{query}

[Response]
{response}

[Criterion: {name}]
{description}
Rubric:
{rubric}

Answer with a JSON object only: {{"score": <integer 1-10>, "reason": "<one or two sentences>"}}"""

RUBRIC_BANDS = ("1-2", "3-4", "5-6", "7-8", "9-10")


class JudgeError(Exception):
    """The judge endpoint could not be reached or answered something unusable."""


class JudgeClient:
    def __init__(self, url: str, model: str, api_key: str | None = None, timeout: float = 120.0,
                 max_retries: int = 3, retry_wait: float = 2.0):
        url = url.rstrip("/")
        self.url = url if url.endswith("/chat/completions") else url + "/chat/completions"
        self.model, self.api_key, self.timeout = model, api_key, timeout
        self.max_retries, self.retry_wait = max_retries, retry_wait

    def chat(self, messages: list[dict], temperature: float = 0.0, max_tokens: int = 512) -> str:
        body = json.dumps({"model": self.model, "messages": messages, "temperature": temperature,
                           "max_tokens": max_tokens}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        for attempt in range(self.max_retries + 1):
            request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    payload = json.loads(response.read().decode("utf-8"))
                return payload["choices"][0]["message"]["content"]
            except urllib.error.HTTPError as e:
                retryable = e.code == 429 or e.code >= 500
                problem = f"HTTP {e.code} {e.reason}"
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                retryable, problem = True, f"cannot reach {self.url} ({getattr(e, 'reason', e)})"
            except (json.JSONDecodeError, KeyError, IndexError, TypeError):
                raise JudgeError(f"{self.url} did not answer an OpenAI-style chat completion") from None
            if not retryable or attempt == self.max_retries:
                raise JudgeError(f"judge request failed after {attempt + 1} attempt(s): {problem}")
            time.sleep(self.retry_wait * 2 ** attempt)


def parse_score(text: str) -> float:
    """The 1-10 score in a judge answer: JSON {"score": ...} (fenced or not), else 'score: N'."""
    match = re.search(r"\{.*\}", text, re.DOTALL)
    score = None
    if match:
        try:
            score = float(json.loads(match.group(0))["score"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            pass
    if score is None:
        found = re.search(r"score\W{0,5}(\d+(?:\.\d+)?)", text, re.IGNORECASE)
        if not found:
            raise JudgeError(f"no score in judge answer: {text[:200]!r}")
        score = float(found.group(1))
    if not 1 <= score <= 10:
        raise JudgeError(f"judge score {score} is outside 1-10")
    return score


def judge_prompt(query: str, response: str, criterion: dict) -> str:
    rubric = "\n".join(f"{band}: {criterion[band]}" for band in RUBRIC_BANDS if band in criterion)
    return JUDGE_INSTRUCTIONS.format(query=query, response=response, name=criterion["name"],
                                     description=criterion["criteria_description"], rubric=rubric)


def score_replies(rows: list[dict], replies: list[str], judge: JudgeClient) -> dict:
    """rows: WritingBench records (query, checklist). Failed criteria are recorded, not fatal."""
    samples = []
    for row, reply in tqdm(list(zip(rows, replies, strict=True)), desc="judging", leave=False):
        scores, errors = {}, []
        for criterion in row["checklist"]:
            try:
                answer = judge.chat([{"role": "user", "content": judge_prompt(row["query"], reply, criterion)}])
                scores[criterion["name"]] = parse_score(answer)
            except JudgeError as e:
                errors.append(f"{criterion['name']}: {e}")
        mean = sum(scores.values()) / len(scores) if scores else None
        samples.append({"index": row.get("index"), "score": mean, "criteria": scores, "errors": errors, "reply": reply})
    scored = [s["score"] for s in samples if s["score"] is not None]
    return {"score": sum(scored) / len(scored) if scored else None, "n_scored": len(scored), "n": len(samples),
            "samples": samples}


def evaluate(rows: list[dict], generate_fn: Callable[[list[str]], list[str]], judge: JudgeClient) -> dict:
    return score_replies(rows, generate_fn([row["query"] for row in rows]), judge)


def main():
    parser = argparse.ArgumentParser(description="WritingBench with an OpenAI-compatible LLM judge.")
    parser.add_argument("--judge_url", required=True, help="base URL of an OpenAI-compatible API")
    parser.add_argument("--judge_model", required=True)
    parser.add_argument("--judge_api_key_env", default="JUDGE_API_KEY",
                        help="environment variable holding the API key (OPENAI_API_KEY is the fallback)")
    parser.add_argument("--queries", help="WritingBench jsonl (default: shared writingbench_length_subset.jsonl)")
    add_generation_args(parser, max_new_tokens=1024, batch_size=4)
    args = parser.parse_args()
    if not args.checkpoint:
        parser.error("--checkpoint is required")
    api_key = os.environ.get(args.judge_api_key_env) or os.environ.get("OPENAI_API_KEY")
    judge = JudgeClient(args.judge_url, args.judge_model, api_key)

    def run():
        rows = read_jsonl(args.queries or data_path("writingbench_length_subset.jsonl"))[: args.limit]
        result = evaluate(rows, load_generate_fn(args.checkpoint, args.device, args.max_new_tokens, args.batch_size), judge)
        if result["score"] is None:
            raise ValueError(f"the judge scored none of the {result['n']} samples; first problem: "
                             f"{result['samples'][0]['errors'][:1]}")
        return result

    run_cli(run, lambda r: f"WritingBench score = {r['score']:.2f} / 10 over {r['n_scored']} of {r['n']} samples",
            args.out)


if __name__ == "__main__":
    main()
