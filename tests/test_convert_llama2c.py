"""convert/llama2c.py: a llama2.c file cut short is refused in one line."""
from script_testing import assert_one_line_error, run_script


def test_truncated_llama2c_file(stories260k_dir, tmp_path):
    data = (stories260k_dir / "stories260K.bin").read_bytes()
    (tmp_path / "cut.bin").write_bytes(data[:50_000])
    done = run_script("convert_hf.py", "--llama2c", tmp_path / "cut.bin", "--out", tmp_path / "out")
    assert_one_line_error(done, "cut.bin ends early")
    assert not (tmp_path / "out").exists()
