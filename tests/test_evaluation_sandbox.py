"""The sandbox runs model-written code in a separate, limited process inside a temp folder."""
import os
from pathlib import Path

from evaluation.sandbox import run_program


def test_passing_program_passes():
    result = run_program("assert sum(range(4)) == 6\nprint('ok')")
    assert result.status == "passed" and result.stdout.strip() == "ok"


def test_failing_program_fails_with_its_error():
    result = run_program("assert 1 + 1 == 3, 'wrong sum'")
    assert result.status == "failed" and "wrong sum" in result.stderr


def test_infinite_loop_times_out():
    assert run_program("while True:\n    pass", timeout=1.0).status == "timeout"


def test_memory_hog_is_stopped():
    result = run_program("hog = bytearray(2 << 30)\nprint('allocated')", memory_mb=256)
    assert result.status == "memory" and "allocated" not in result.stdout


def test_files_are_written_only_in_a_temp_folder_that_is_removed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # were the program run here, the file would appear here
    result = run_program("import os\nopen('written.txt', 'w').write('x')\nprint(os.getcwd())")
    assert result.passed
    workdir = Path(result.stdout.strip())
    assert workdir != tmp_path and not (tmp_path / "written.txt").exists()
    assert not workdir.exists(), "the sandbox folder should be deleted after the run"


def test_code_runs_in_another_process():
    marker = "SANDBOX_TEST_MARKER"
    result = run_program(f"import os, builtins\nbuiltins.{marker} = 1\nos.environ['{marker}'] = '1'\nprint(os.getpid())")
    assert result.passed and int(result.stdout) != os.getpid()
    import builtins
    assert not hasattr(builtins, marker) and marker not in os.environ
