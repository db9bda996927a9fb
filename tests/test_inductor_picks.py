"""scripts/inductor_picks.py: each pick in an Inductor cache named after the kernel it tuned.

The cache below is laid out as torch's Inductor and Triton's sources say they lay it out (a
best_config beside the kernel's source; Triton's cache under triton/<device>/<hash>/, its files
named after the kernel); not yet checked against a cache written on the H200."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "inductor_picks.py"


def write_pick(cache: Path, kernel: str, triton_hash: str, config: dict):
    compiled = cache / "triton" / "0" / triton_hash
    compiled.mkdir(parents=True)
    for name in (f"__grp__{kernel}.json", f"{kernel}.json", f"{kernel}.cubin"):
        (compiled / name).write_text("{}")
    source_dir = cache / triton_hash[:2].lower()
    source_dir.mkdir(exist_ok=True)
    (source_dir / f"{triton_hash.lower()}.best_config").write_text(json.dumps(
        {**config, "time_taken_ms": 0.03, "triton_cache_hash": triton_hash, "configs_hash": "c0ffee"}))


def test_each_pick_is_named_after_its_kernel_and_keeps_only_the_config(tmp_path):
    w2 = {"R0_BLOCK": 2048, "XBLOCK": 1, "found_by_coordesc": True, "num_stages": 1, "num_warps": 16}
    qkv = {"R0_BLOCK": 1024, "XBLOCK": 2, "found_by_coordesc": True, "num_stages": 1, "num_warps": 8}
    write_pick(tmp_path, "triton_red_fused__unsafe_view_mm_mul_silu_split_t_view_8", "AB3XQ", w2)
    write_pick(tmp_path, "triton_red_fused_mm_t_transpose_unsqueeze_view_5", "ZZ7KL", qkv)
    # a pick whose compiled kernel is not in this cache keeps "?" for its name
    (tmp_path / "orphan.best_config").write_text(json.dumps({**qkv, "triton_cache_hash": "GONE"}))
    lines = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    rows = {line.split(" ", 2)[1]: json.loads(line.split(" ", 2)[2]) for line in lines}
    assert rows == {"triton_red_fused__unsafe_view_mm_mul_silu_split_t_view_8": w2,
                    "triton_red_fused_mm_t_transpose_unsqueeze_view_5": qkv, "?": qkv}


def test_a_missing_cache_directory_is_one_clear_error(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "nowhere")], capture_output=True, text=True)
    assert result.returncode != 0 and "an existing directory" in result.stderr
