"""Read the sparse formats of compressed-tensors (0.14.x and earlier): `sparse-24-bitmask` and
`sparse-bitmask`, named by `quantization_config.sparsity_config.format` in config.json.

Each compressed weight `<layer>.weight` is stored as
- `<layer>.shape`: the dense (rows, columns), as a 2-element tensor (any shape);
- `<layer>.bitmask`: uint8 (rows, ceil(columns / 8)), numpy packbits of the kept positions along
  each row, little-endian bit order (bit j of byte b is column 8b + j);
- `<layer>.compressed`: the kept values in row-major order: (rows, columns / 2) for 2:4, flat for
  `sparse-bitmask`;
- `<layer>.row_offsets` (`sparse-bitmask` only): where each row's values start in `compressed`.
Decompressing gives the dense weight with exact zeros; convert/packing.py then finds its N:M pattern.
"""
import torch

from convert.writer import ConversionError, LazyTensors

FORMATS = ("sparse-24-bitmask", "sparse-bitmask")
PARTS = ("shape", "bitmask", "compressed", "row_offsets")


def sparsity_format(hf_config: dict):
    """The compressed-tensors sparse format config.json declares, or None for a plain model.
    Quantized compressed-tensors checkpoints are refused: we run float weights only."""
    quantization = hf_config.get("quantization_config")
    if not quantization:
        return None
    if quantization.get("quant_method") != "compressed-tensors":
        raise ConversionError(f"config.json: quantization method '{quantization.get('quant_method')}' "
                              f"is not supported (only float weights, or compressed-tensors sparsity)")
    if quantization.get("config_groups"):
        raise ConversionError("config.json: this compressed-tensors checkpoint is quantized "
                              "(quantization_config.config_groups); only its sparse float formats are supported")
    kind = (quantization.get("sparsity_config") or {}).get("format", "dense")
    if kind == "dense":
        return None
    if kind not in FORMATS:
        raise ConversionError(f"config.json: compressed-tensors format '{kind}' is not supported "
                              f"(supported: {', '.join(FORMATS)})")
    return kind


def unpack_bitmask(bitmask: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """uint8 (rows, ceil(columns / 8)) little-endian packed bits -> bool (rows, columns)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    bits = (bitmask.to(torch.uint8)[..., None] >> shifts) & 1
    return bits.reshape(rows, -1)[:, :columns].bool()


def decompress(layer: str, parts: dict, kind: str) -> torch.Tensor:
    """The dense weight of one compressed layer (parts: its stored tensors by suffix)."""
    shape = [int(x) for x in parts["shape"].flatten().tolist()]
    if len(shape) != 2:
        raise ConversionError(f"{layer}.shape is {shape}, not (rows, columns)")
    rows, columns = shape
    if tuple(parts["bitmask"].shape) != (rows, (columns + 7) // 8):
        raise ConversionError(f"{layer}.bitmask has shape {tuple(parts['bitmask'].shape)}, expected "
                              f"{(rows, (columns + 7) // 8)} for a {rows}x{columns} weight")
    kept = unpack_bitmask(parts["bitmask"], rows, columns)
    values = parts["compressed"].flatten()
    if int(kept.sum()) != values.numel():
        raise ConversionError(f"{layer}: the bitmask keeps {int(kept.sum())} weights but "
                              f"{layer}.compressed holds {values.numel()}")
    if kind == "sparse-bitmask":
        counts = kept.sum(-1)
        offsets = torch.cumsum(counts, 0) - counts
        if not torch.equal(parts["row_offsets"].flatten().to(offsets.dtype), offsets):
            raise ConversionError(f"{layer}.row_offsets disagree with its bitmask")
    elif not bool((kept.reshape(rows, -1, 4).sum(-1) == 2).all()):
        raise ConversionError(f"{layer}.bitmask does not keep 2 of every 4 weights (sparse-24-bitmask)")
    dense = torch.zeros(rows, columns, dtype=values.dtype)
    dense[kept] = values
    return dense


def decompressed_tensors(tensors: LazyTensors, kind: str) -> LazyTensors:
    """`tensors` with each compressed layer's parts replaced by a loader of `<layer>.weight`."""
    needed = ("shape", "bitmask", "compressed") + (("row_offsets",) if kind == "sparse-bitmask" else ())
    layers = {name[:-len(".compressed")] for name in tensors if name.endswith(".compressed")}
    result = {name: load for name, load in tensors.items()
              if not (name.rpartition(".")[0] in layers and name.rpartition(".")[2] in PARTS)}
    for layer in sorted(layers):
        missing = [part for part in needed if f"{layer}.{part}" not in tensors]
        if missing:
            raise ConversionError(f"{kind} layer {layer} has no {layer}.{missing[0]}")

        def load(layer=layer):
            return decompress(layer, {p: tensors[f"{layer}.{p}"]() for p in needed}, kind)
        result[f"{layer}.weight"] = load
    return result
