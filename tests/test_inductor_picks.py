"""scripts/inductor_picks.py: each kernel's pick from the coordinate-descent tuner's debug log, set
beside the kernel's time in a decode-step profile. The log lines are the format
torch/_inductor/runtime/coordinate_descent_tuner.py writes (behind torch's logging prefix); the
profile is bench_decode.py --profile's table."""
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "inductor_picks.py"
W2 = "triton_red_fused__unsafe_view_mm_mul_silu_split_t_view_5"
QKV = "triton_red_fused_mm_t_transpose_unsqueeze_view_2"
PICK = "XBLOCK: 1, R0_BLOCK: 2048, num_warps: 16, num_ctas: 1, num_stages: 1, maxnreg: None"
BASELINE = "XBLOCK: 1, R0_BLOCK: 1024, num_warps: 8, num_ctas: 1, num_stages: 1, maxnreg: None"

LOG = f"""\
V1204 15:40:01.000000 123 torch/_inductor/runtime/coordinate_descent_tuner.py:382] = Do coordinate descent tuning for {W2} =
V1204 15:40:01.000000 123 torch/_inductor/runtime/coordinate_descent_tuner.py:335] Tune from {BASELINE} 0.034000 -> {PICK} 0.029500
V1204 15:40:02.000000 123 torch/_inductor/runtime/coordinate_descent_tuner.py:432] {W2}: Improve from {BASELINE} 0.034000 -> {PICK} 0.029500, 1.153x
V1204 15:40:03.000000 123 torch/_inductor/runtime/coordinate_descent_tuner.py:432] {QKV}: Improve from {BASELINE} 0.011000 -> {BASELINE} 0.011000, 1.000x
some other output
"""

PROFILE = f"""\
255 decode steps (+ one prefill, included below); GPU kernel time per step 5229.4 us
  us/step calls/step  kernel
   1452.0      32.00  {W2}
    146.0      16.00  {QKV}

timeline: span 5400.0 us/step
"""


def run(*paths):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, paths)], capture_output=True, text=True)


def test_each_pick_beside_its_tuned_time_and_its_time_in_the_step(tmp_path):
    (tmp_path / "run.log").write_text(LOG)
    (tmp_path / "profile.txt").write_text(PROFILE)
    result = run(tmp_path / "run.log", tmp_path / "profile.txt")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [  # in the order tuned
        f"{W2} | tuned 29.5 us (baseline 34.0) | in the step 45.4 us a call | {PICK}",
        f"{QKV} | tuned 11.0 us (baseline 11.0) | in the step 9.1 us a call | {BASELINE}",
    ]


def test_without_a_profile_the_step_column_is_empty_and_a_log_without_searches_says_so(tmp_path):
    (tmp_path / "run.log").write_text(LOG)
    assert f"{W2} | tuned 29.5 us (baseline 34.0) | in the step - us a call" in run(tmp_path / "run.log").stdout
    (tmp_path / "quiet.log").write_text("nothing tuned here\n")
    assert "was TORCH_LOGS set?" in run(tmp_path / "quiet.log").stdout


def test_a_missing_log_is_one_clear_error(tmp_path):
    result = run(tmp_path / "nowhere.log")
    assert result.returncode != 0 and "existing files" in result.stderr
