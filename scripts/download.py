"""Download a model from the Hugging Face hub into checkpoints/<repo_id>, then optionally convert it.

    python scripts/download.py --repo_id Qwen/Qwen3-0.6B --convert     # -> checkpoints/Qwen/Qwen3-0.6B/model.pth
    python scripts/download.py --repo_id meta-llama/Llama-3.1-8B-Instruct --hf_token $HF_TOKEN

Only what conversion needs is fetched: configs, safetensors weights and tokenizer files
(pytorch_model*.bin with --bin, for repos that have no safetensors). Without network access this
says so in one line; copy the model folder by other means and run convert_hf.py on it.
"""
import argparse
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
import cli_args  # noqa: E402

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def repo_id(text: str) -> str:
    """An argparse type: the hub's owner/name form, refused before any request."""
    if not REPO_ID.fullmatch(text) or ".." in text:
        raise argparse.ArgumentTypeError(f"expected owner/name (e.g. Qwen/Qwen3-0.6B), got '{text}'")
    return text


ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja", "vocab.json", "merges.txt"]


def download(repo_id: str, out: Path, token=None, include_bin: bool = False) -> Path:
    """Fetch repo_id into out; raises RuntimeError with one line when the hub cannot be used."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    created = not out.exists()
    patterns = ALLOW_PATTERNS + (["pytorch_model*.bin"] if include_bin else [])
    try:
        snapshot_download(repo_id, local_dir=out, allow_patterns=patterns, token=token)
    except BaseException as e:
        if created and out.exists():  # leave no empty or partial folder behind a failed first download
            shutil.rmtree(out)
        if isinstance(e, GatedRepoError):
            raise RuntimeError(f"{repo_id} is gated: accept its license on the hub and pass --hf_token") from None
        if isinstance(e, RepositoryNotFoundError):
            raise RuntimeError(f"{repo_id} not found on the Hugging Face hub (or it is private: pass --hf_token)") from None
        if isinstance(e, (LocalEntryNotFoundError, HfHubHTTPError, OSError)):
            raise RuntimeError(f"cannot reach the Hugging Face hub to download {repo_id} ({type(e).__name__}); "
                               f"copy the model folder here by other means and run scripts/convert_hf.py on it") from None
        raise
    return out


def main(argv=None):
    parser = cli_args.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo_id", type=repo_id, required=True, help="e.g. Qwen/Qwen3-0.6B")
    parser.add_argument("--out", type=Path, help="target folder (default: checkpoints/<repo_id>)")
    parser.add_argument("--hf_token", default=None, help="for gated or private repos")
    parser.add_argument("--bin", action="store_true", help="also fetch pytorch_model*.bin (repos without safetensors)")
    parser.add_argument("--convert", action="store_true", help="then run convert_hf.py on the folder, in place")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    args = parser.parse_args(argv)
    out = args.out or Path("checkpoints") / args.repo_id
    try:
        download(args.repo_id, out, args.hf_token, args.bin)
    except RuntimeError as e:
        cli_args.exit_with_error(e, parser.prog)
    print(f"downloaded {args.repo_id} to {out}")
    if args.convert:
        from scripts.convert_hf import main as convert
        convert([str(out), "--out", str(out), "--dtype", args.dtype])


if __name__ == "__main__":
    main()
