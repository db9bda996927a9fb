"""Turn outside model files into our checkpoint: <out>/model.pth (+ config.json) and the tokenizer files.

Every reader (hf.py: Hugging Face folders, gguf.py: llama.cpp's GGUF, llama2c.py: llama2.c .bin)
yields tensors under Hugging Face's names, in Hugging Face's layout (rotate-half RoPE), a ModelArgs
and the tokenizer files; writer.py fuses them into our keys, checks every name and shape, and writes
the checkpoint atomically. scripts/convert_hf.py is the command line.

export_hf.py goes the other way: our checkpoint -> a Hugging Face folder (scripts/export_hf.py).
"""
from convert.export_hf import export_to_hf
from convert.gguf import convert_gguf, embedded_smollm2_gguf
from convert.hf import convert_hf_folder
from convert.llama2c import convert_llama2c
from convert.writer import DTYPES, ConversionError

__all__ = ["DTYPES", "ConversionError", "convert_gguf", "convert_hf_folder", "convert_llama2c", "embedded_smollm2_gguf",
           "export_to_hf"]
