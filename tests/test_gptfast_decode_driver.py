"""scripts/gptfast_decode_driver.py: GPT-Fast's decode timed as bench_decode.py times ours. GPT-Fast
is not part of this repository; the test runs where a copy sits in .gptfast (or $GPTFAST_DIR)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GPTFAST = Path(os.environ.get("GPTFAST_DIR", REPO / ".gptfast"))


@pytest.mark.skipif(not (GPTFAST / "generate.py").exists(),
                    reason=f"no copy of pytorch-labs/gpt-fast in {GPTFAST} (see the script's docstring)")
def test_driver_times_gptfast_decode_on_cpu():
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "gptfast_decode_driver.py"), "--gptfast_dir",
                             str(GPTFAST), "--model", "stories15M", "--device", "cpu", "--no_compile",
                             "--prompt_length", "16", "--new_tokens", "30", "--warmup_steps", "5"],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    timing = json.loads(result.stdout.strip().splitlines()[-1])
    assert timing["measured_steps"] == 30 - 1 - 5 and 0 < timing["median_step_s"] < 1
