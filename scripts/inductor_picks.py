"""List the configs Inductor's autotuner picked, each beside the name of the kernel it tuned.

    python scripts/inductor_picks.py INDUCTOR_CACHE_DIR > picks.txt

One line per *.best_config file (coordinate descent leaves one per tuned kernel): the file's name,
the kernel's name as a profile shows it (triton_red_fused_..._8) or "?", and the config picked,
without the fields that differ even for the same pick. dense_spread.sh uses it to set each dense
GEMV's pick beside that kernel's time in the profile (the dense spread is the picks; BENCHMARKS
session 19).

How the name is found: a best_config records triton_cache_hash, the name of the directory Triton
compiled that kernel into; Triton names the files there after the kernel (NAME.json, NAME.cubin,
__grp__NAME.json). Inductor keeps Triton's cache inside its own (TRITON_CACHE_DIR when set). On
2026-12-04 (session 20) the earlier guess, rebuilding the config file's name from each source
file's path with Inductor's private AutotuneCache key helpers, named none of 23 picks.
"""
import json
import os
import pathlib
import sys

VARYING_FIELDS = ("time_taken_ms", "triton_cache_hash", "configs_hash")


def kernel_names_by_triton_hash(roots: list[pathlib.Path]) -> dict[str, str]:
    """{Triton cache directory name: kernel name} for every compiled kernel under roots."""
    names = {}
    for root in roots:
        for group in root.rglob("__grp__*.json"):
            names[group.parent.name] = group.name[len("__grp__"):-len(".json")]
    return names


def picks(inductor_cache: pathlib.Path) -> list[str]:
    roots = [inductor_cache] + [pathlib.Path(p) for p in [os.environ.get("TRITON_CACHE_DIR")] if p]
    name_of = kernel_names_by_triton_hash(roots)
    lines = []
    for path in sorted(inductor_cache.rglob("*.best_config")):
        config = json.loads(path.read_text())
        picked = {k: v for k, v in config.items() if k not in VARYING_FIELDS}
        lines.append(f"{path.name} {name_of.get(config.get('triton_cache_hash'), '?')} "
                     f"{json.dumps(picked, sort_keys=True)}")
    return lines


if __name__ == "__main__":
    if len(sys.argv) != 2 or not pathlib.Path(sys.argv[1]).is_dir():
        sys.exit("usage: python scripts/inductor_picks.py INDUCTOR_CACHE_DIR (an existing directory)")
    print("\n".join(picks(pathlib.Path(sys.argv[1]))))
