"""scripts/compile_time.py: on a machine without a GPU it compiles for its sm_90 stand-in. Run in a
subprocess, as a user runs it: the script makes the stand-in Triton's driver for its whole process."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the stand-in path; on a GPU the script compiles for it")
def test_compile_time_compiles_every_candidate_kernel_at_each_thread_count(tmp_path):
    out = tmp_path / "compile_time.json"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_time.py"), "--kernels", "spmv",
                             "--shape", "64x256", "--rows", "2", "--threads", "1,2", "--out-json", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and [row["threads"] for row in report["rows"]] == [1, 2]
    sys.path.insert(0, str(ROOT))
    from sparse import kernels
    configs = kernels.candidate_configs(64, 8, 2)
    for row in report["rows"]:  # configs that differ only in run-time arguments share a kernel
        assert row["configs"] == len(configs) and 1 <= row["compiled"] <= len(configs) and row["seconds"] > 0
    assert report["rows"][0]["compiled"] == report["rows"][1]["compiled"]
    assert "| spmv | " in result.stdout
