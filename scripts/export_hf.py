"""Write our checkpoint (dense or packed N:M) as a Hugging Face model folder.

    python scripts/export_hf.py --checkpoint pruned.pth --out exported/
    python -c "import transformers; transformers.AutoModelForCausalLM.from_pretrained('exported/')"

Packed layers become dense safetensors with exact zeros, q/k/v and gate/up are split back, and the
folder has config.json (the source architecture), generation_config.json and the tokenizer files.
The exporter is convert/export_hf.py; this is its command line.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

import cli_args  # noqa: E402
from checkpoint import CheckpointError  # noqa: E402
from convert import DTYPES, ConversionError, export_to_hf  # noqa: E402


def main(argv=None):
    parser = cli_args.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", "--checkpoint_path", type=Path, required=True,
                        help="our checkpoint (.pth), dense or packed-sparse")
    parser.add_argument("--out", type=Path, required=True, help="new folder for the Hugging Face model")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="weight dtype (default: the checkpoint's)")
    args = parser.parse_args(argv)
    try:
        export_to_hf(args.checkpoint, args.out, DTYPES[args.dtype] if args.dtype else None)
    except (ConversionError, CheckpointError) as e:
        cli_args.exit_with_error(e)


if __name__ == "__main__":
    main()
