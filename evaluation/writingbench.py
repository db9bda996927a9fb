"""WritingBench scoring with an LLM judge behind any OpenAI-compatible chat-completions endpoint.

WritingBench gives each query five criteria, each with a 1-10 rubric. The judge scores the reply
once per criterion; a sample's score is the mean over its scored criteria, the benchmark's score the
mean over samples (1-10 scale).

The judge's output contract (stated in JUDGE_INSTRUCTIONS): exactly one JSON object
{"score": <integer 1-10>, "reason": "..."}, bare or inside one ```json fence. Only that `score`
field counts; a boolean, float or string score, two JSON values, or a number anywhere else in the
text is not read as a score. Any answer that breaks the contract, and any failed or malformed HTTP
exchange, becomes an error record for that criterion and the pass goes on; the summary counts
these errors and the mean leaves them out.

The endpoint is whatever the user configures: --judge_url (a base URL such as
http://host:8000/v1, or the full .../chat/completions), --judge_model, and the API key from the
environment variable named by --judge_api_key_env (default JUDGE_API_KEY, then OPENAI_API_KEY).
Only the standard library talks to it. Each judge request, retries and their waits included, ends
within --judge_timeout seconds of wall-clock time, however slowly the server sends its bytes.

CLI: python -m evaluation.writingbench --checkpoint model.pth --judge_url http://127.0.0.1:8000/v1
         --judge_model NAME [--limit 10] [--max_new_tokens 1024] [--judge_timeout 120] [--out wb.json]
"""
import http.client
import json
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Callable

from tqdm import tqdm

import cli_args
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

Reply with exactly one JSON object and nothing else: {{"score": <integer 1-10>, "reason": "<one or two sentences>"}}
The score must be a JSON integer such as 7 (not "7", 7.5 or true); only the "score" field is read."""

RUBRIC_BANDS = ("1-2", "3-4", "5-6", "7-8", "9-10")
MAX_BODY_BYTES = 4 << 20  # a chat completion of max_tokens=512 is a few KiB; more is not a judge answer


class JudgeError(Exception):
    """The judge endpoint could not be reached or answered something unusable."""


class _Transient(JudgeError):
    """A failure worth another attempt (rate limit, server error, refused connection)."""


def _json_type(value) -> str:
    names = {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _excerpt(text: str, limit: int = 120) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


class _Deadline:
    """Shuts a request's sockets down when its time is up. A socket timeout bounds each read, not
    their sum, so without this a server trickling a byte at a time could hold the pass forever."""

    def __init__(self, seconds: float):
        self.expired = False
        self._sockets, self._lock = [], threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self):
        self._timer.start()
        return self

    def __exit__(self, *exc):
        self._timer.cancel()

    def watch(self, connection):
        """Track a connection's socket from the moment it is connected (urllib drops its own
        reference to the socket once the headers are in, while the body is still to come)."""
        connect = connection.connect

        def watched_connect():
            connect()
            with self._lock:
                self._sockets.append(connection.sock)
                if self.expired:
                    self._shut(connection.sock)

        connection.connect = watched_connect
        return connection

    def _expire(self):
        with self._lock:
            self.expired = True
            for sock in self._sockets:
                self._shut(sock)

    @staticmethod
    def _shut(sock):
        try:
            sock.shutdown(socket.SHUT_RDWR)  # a blocked read returns at once; close() would not wake it
        except OSError:
            pass


class _DeadlineHandler:
    """urllib handler mix-in: every connection it opens is watched by one _Deadline."""

    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def do_open(self, http_class, req, **kwargs):
        def connection(*args, **kw):
            return self.deadline.watch(http_class(*args, **kw))
        return super().do_open(connection, req, **kwargs)


class _HTTPHandler(_DeadlineHandler, urllib.request.HTTPHandler):
    pass


class _HTTPSHandler(_DeadlineHandler, urllib.request.HTTPSHandler):
    pass


def completion_content(body: bytes) -> str:
    """The reply text of an OpenAI-style chat-completion body; JudgeError says what is wrong with it."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise JudgeError(f"body is not valid UTF-8 (byte {body[e.start]:#04x} at offset {e.start})") from None
    if not text.strip():
        raise JudgeError("body is empty")
    try:
        payload = json.loads(text)
    except json.JSONDecodeError as e:
        raise JudgeError(f"body is not JSON ({e.msg} at char {e.pos}): {_excerpt(text)}") from None
    if not isinstance(payload, dict):
        raise JudgeError(f"body is a JSON {_json_type(payload)}, not a chat completion object")
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices:
        error = payload.get("error")
        if error:
            message = error.get("message", error) if isinstance(error, dict) else error
            raise JudgeError(f"judge answered an error: {_excerpt(str(message))}")
        raise JudgeError("answer has no choices")
    message = choices[0].get("message") if isinstance(choices[0], dict) else None
    if not isinstance(message, dict):
        raise JudgeError("answer has no choices[0].message")
    if "content" not in message:
        raise JudgeError("choices[0].message has no content")
    content = message["content"]
    if not isinstance(content, str):
        kind = "null" if content is None else f"a JSON {_json_type(content)}"
        raise JudgeError(f"choices[0].message.content is {kind}, not a string")
    return content


class JudgeClient:
    def __init__(self, url: str, model: str, api_key: str | None = None, timeout: float = 120.0,
                 max_retries: int = 3, retry_wait: float = 2.0):
        """timeout: wall-clock seconds one chat() call may take in all, retries and waits included."""
        url = url.rstrip("/")
        self.url = url if url.endswith("/chat/completions") else url + "/chat/completions"
        self.model, self.api_key, self.timeout = model, api_key, timeout
        self.max_retries, self.retry_wait = max_retries, retry_wait

    def chat(self, messages: list[dict], temperature: float = 0.0, max_tokens: int = 512) -> str:
        """The judge's reply text, or JudgeError with the reason there is none."""
        body = json.dumps({"model": self.model, "messages": messages, "temperature": temperature,
                           "max_tokens": max_tokens}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        deadline = time.monotonic() + self.timeout
        for attempt in range(1, self.max_retries + 2):
            try:
                return completion_content(self._post(body, headers, deadline - time.monotonic()))
            except _Transient as e:
                problem = e
            wait = self.retry_wait * 2 ** (attempt - 1)
            if attempt > self.max_retries or time.monotonic() + wait >= deadline:
                raise JudgeError(f"{problem} (gave up after {attempt} attempt(s))")
            time.sleep(wait)

    def _post(self, body: bytes, headers: dict, seconds: float) -> bytes:
        """One POST; its body, read in full before `seconds` of wall-clock time have passed."""
        timed_out = JudgeError(f"no complete answer from {self.url} within {self.timeout:g} s")
        if seconds <= 0:
            raise timed_out
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        with _Deadline(seconds) as deadline:
            opener = urllib.request.build_opener(_HTTPHandler(deadline), _HTTPSHandler(deadline))
            try:
                with opener.open(request, timeout=seconds) as response:
                    declared = response.headers.get("Content-Length", "")
                    received = bytearray()
                    while chunk := response.read(1 << 16):
                        received += chunk
                        if len(received) > MAX_BODY_BYTES:
                            raise JudgeError(f"body is larger than {MAX_BODY_BYTES} bytes")
            except urllib.error.HTTPError as e:
                e.close()
                failure = _Transient if e.code == 429 or e.code >= 500 else JudgeError
                raise failure(f"HTTP {e.code} {e.reason}") from None
            except http.client.IncompleteRead as e:
                raise timed_out if deadline.expired else JudgeError(
                    f"truncated body ({len(e.partial)} bytes, then the connection closed)") from None
            except (OSError, http.client.HTTPException) as e:  # URLError is an OSError
                reason = getattr(e, "reason", e)
                if deadline.expired or isinstance(reason, TimeoutError):
                    raise timed_out from None
                if isinstance(e, http.client.HTTPException):
                    raise JudgeError(f"malformed HTTP response ({type(e).__name__}: {_excerpt(str(e))})") from None
                raise _Transient(f"cannot reach {self.url} ({reason})") from None
            if deadline.expired:
                raise timed_out
        if declared.isdigit() and int(declared) != len(received):
            raise JudgeError(f"truncated body ({len(received)} of {declared} bytes)")
        return bytes(received)


_FENCE = re.compile(r"```(?:json)?[ \t]*\n(.*?)\n[ \t]*```", re.DOTALL | re.IGNORECASE)


def _no_duplicate_keys(pairs):
    keys = [key for key, _ in pairs]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise JudgeError(f"judge answer gives {repeated[0]!r} more than once, so it is ambiguous")
    return dict(pairs)


def parse_score(text: str) -> int:
    """The `score` of a judge answer under the contract in JUDGE_INSTRUCTIONS: the whole answer is one
    JSON object (optionally inside one ```json fence) whose "score" is an integer from 1 to 10."""
    body = text.strip()
    fenced = _FENCE.fullmatch(body)
    if fenced:
        body = fenced.group(1).strip()
    if "```" in body:
        raise JudgeError(f"judge answer is not one JSON object in at most one fence: {_excerpt(text)}")
    decoder = json.JSONDecoder(object_pairs_hook=_no_duplicate_keys)
    try:
        answer, end = decoder.raw_decode(body)
    except json.JSONDecodeError:
        raise JudgeError(f"judge answer is not a JSON object: {_excerpt(text)}") from None
    rest = body[end:].strip()
    if rest:
        try:
            decoder.raw_decode(rest)
        except json.JSONDecodeError:
            raise JudgeError(f"judge answer has text after its JSON object: {_excerpt(rest)}") from None
        raise JudgeError("judge answer holds more than one JSON value, so its score is ambiguous")
    if not isinstance(answer, dict):
        raise JudgeError(f"judge answer is a JSON {_json_type(answer)}, not an object")
    if "score" not in answer:
        raise JudgeError(f'judge answer has no "score" field: {_excerpt(text)}')
    score = answer["score"]
    if type(score) is not int:  # bool is a subclass of int, and not a score
        raise JudgeError(f"judge score {json.dumps(score)} is a JSON {_json_type(score)}, not an integer")
    if not 1 <= score <= 10:
        raise JudgeError(f"judge score {score} is outside 1-10")
    return score


def judge_prompt(query: str, response: str, criterion: dict) -> str:
    rubric = "\n".join(f"{band}: {criterion[band]}" for band in RUBRIC_BANDS if band in criterion)
    return JUDGE_INSTRUCTIONS.format(query=query, response=response, name=criterion["name"],
                                     description=criterion["criteria_description"], rubric=rubric)


def score_replies(rows: list[dict], replies: list[str], judge: JudgeClient) -> dict:
    """rows: WritingBench records (query, checklist). A criterion the judge fails on is recorded in
    its sample's errors as {"criterion", "error"} and left out of every mean; the pass goes on."""
    samples, n_errors = [], 0
    progress = tqdm(list(zip(rows, replies, strict=True)), desc="judging", leave=False)
    for row, reply in progress:
        scores, errors = {}, []
        for criterion in row["checklist"]:
            try:
                answer = judge.chat([{"role": "user", "content": judge_prompt(row["query"], reply, criterion)}])
                scores[criterion["name"]] = parse_score(answer)
            except JudgeError as e:
                errors.append({"criterion": criterion["name"], "error": str(e)})
        n_errors += len(errors)
        progress.set_postfix(judge_errors=n_errors)
        mean = sum(scores.values()) / len(scores) if scores else None
        samples.append({"index": row.get("index"), "score": mean, "criteria": scores, "errors": errors, "reply": reply})
    scored = [s["score"] for s in samples if s["score"] is not None]
    return {"score": sum(scored) / len(scored) if scored else None, "n_scored": len(scored), "n": len(samples),
            "n_judgements": n_errors + sum(len(s["criteria"]) for s in samples), "n_errors": n_errors,
            "samples": samples}


def evaluate(rows: list[dict], generate_fn: Callable[[list[str]], list[str]], judge: JudgeClient) -> dict:
    return score_replies(rows, generate_fn([row["query"] for row in rows]), judge)


def summary(result: dict) -> str:
    line = f"WritingBench score = {result['score']:.2f} / 10 over {result['n_scored']} of {result['n']} samples"
    if result["n_errors"]:
        line += (f"; {result['n_errors']} of {result['n_judgements']} judgements failed and are left out "
                 f"of the mean (each sample's \"errors\" in the JSON says why)")
    return line


def main():
    parser = cli_args.ArgumentParser(description="WritingBench with an OpenAI-compatible LLM judge.")
    parser.add_argument("--judge_url", required=True, help="base URL of an OpenAI-compatible API")
    parser.add_argument("--judge_model", required=True)
    parser.add_argument("--judge_api_key_env", default="JUDGE_API_KEY",
                        help="environment variable holding the API key (OPENAI_API_KEY is the fallback)")
    parser.add_argument("--judge_timeout", type=float, default=120.0,
                        help="wall-clock seconds per judge request, retries included")
    parser.add_argument("--queries", help="WritingBench jsonl (default: shared writingbench_length_subset.jsonl)")
    add_generation_args(parser, max_new_tokens=1024, batch_size=4)
    args = parser.parse_args()
    if not args.checkpoint:
        parser.error("--checkpoint is required")
    if not args.judge_timeout > 0:
        parser.error("--judge_timeout must be positive")
    api_key = os.environ.get(args.judge_api_key_env) or os.environ.get("OPENAI_API_KEY")
    judge = JudgeClient(args.judge_url, args.judge_model, api_key, timeout=args.judge_timeout)

    def run():
        rows = read_jsonl(args.queries or data_path("writingbench_length_subset.jsonl"))[: args.limit]
        result = evaluate(rows, load_generate_fn(args.checkpoint, args.device, args.max_new_tokens, args.batch_size), judge)
        if result["score"] is None:
            first = next((e for s in result["samples"] for e in s["errors"]), None)
            raise ValueError(f"the judge scored none of the {result['n']} samples; first problem: {first}")
        return result

    run_cli(run, summary, args.out)


if __name__ == "__main__":
    main()
