"""The sandbox runs model-written code contained: no network, no writes outside its own temporary
folder, a process limit, capped output, and nothing left running when run_program returns."""
import os
import resource
import signal
import socket
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from evaluation import sandbox
from evaluation.sandbox import SandboxUnavailable, run_program

REPO = Path(__file__).resolve().parents[1]


def processes_with(token: str) -> list[int]:
    """Host pids whose command line contains `token`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and token.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
        except OSError:
            pass
    return found


def kill_all(pids):
    for pid in pids:  # only processes this test started, found by their unique token
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


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


def test_setsid_child_dies_with_the_call_even_holding_stdout():
    token, late_file = f"sandbox-escape-{uuid.uuid4().hex}", Path(f"/tmp/sandbox-late-{uuid.uuid4().hex}")
    # The child leaves the process group and session, keeps stdout open, and writes a file 3 s later.
    child = f"import time, sys; time.sleep(3); open({str(late_file)!r}, 'w').write('escaped'); time.sleep(4)"
    program = textwrap.dedent(f"""
        import os, sys
        if os.fork() == 0:
            os.setsid()
            os.execv(sys.executable, [sys.executable, '-c', {child!r}, {token!r}])
        print('parent exits')
    """)
    try:
        start = time.monotonic()
        run_program(program, timeout=2.0)
        elapsed = time.monotonic() - start
        assert elapsed < 3.0, f"the call waited {elapsed:.1f} s for a descendant holding stdout"
        assert processes_with(token) == [], "a descendant is still running after the call returned"
        time.sleep(4)
        assert not late_file.exists()
    finally:
        kill_all(processes_with(token))
        late_file.unlink(missing_ok=True)


def test_fork_storm_is_bounded():
    program = textwrap.dedent("""
        import os, time
        started = 0
        for _ in range(200):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                time.sleep(30)
                os._exit(0)
            started += 1
        print(started)
    """)
    start = time.monotonic()
    result = run_program(program, timeout=5.0, max_processes=16)
    assert time.monotonic() - start < 5.0
    assert result.passed and int(result.stdout) < 16, result


def test_no_writes_outside_its_temporary_folder():
    targets = [Path(f"/tmp/sandbox-outside-{uuid.uuid4().hex}"), REPO / f"sandbox-outside-{uuid.uuid4().hex}"]
    attempt = "try:\n    open({0!r}, 'w').write('x')\n    print('wrote', {0!r})\nexcept OSError as e:\n    print('refused', e.errno)\n"
    program = "".join(attempt.format(str(t)) for t in targets)
    try:
        result = run_program(program)
        assert "wrote" not in result.stdout and result.stdout.count("refused") == 2, result
        assert not any(t.exists() for t in targets)
    finally:
        for t in targets:
            t.unlink(missing_ok=True)


def test_no_network_to_a_local_listener():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        result = run_program(textwrap.dedent(f"""
            import socket
            try:
                with socket.create_connection(('127.0.0.1', {port}), timeout=2) as s:
                    s.sendall(b'leaked')
                print('connected')
            except OSError as e:
                print('refused', e.errno)
        """))
        assert "refused" in result.stdout, result
        with pytest.raises(socket.timeout):
            listener.accept()


def test_huge_output_is_capped_and_the_evaluator_stays_small():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    result = run_program("import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(400):\n    sys.stdout.write(chunk)\n",
                         timeout=10.0)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert result.status == "output"
    assert len(result.stdout) <= sandbox.OUTPUT_TAIL_CHARS
    assert grown_mb < 64, f"the evaluator grew by {grown_mb:.0f} MB"


@pytest.mark.parametrize("exit_call", ["import sys; sys.exit(0)", "import os; os._exit(0)", "raise SystemExit"])
def test_early_exit_before_the_success_marker_fails(exit_call):
    program = f"{exit_call}\nassert False, 'the tests'\nprint('MARKER-1234')\n"
    assert run_program(program, success_marker="MARKER-1234").status == "failed"
    assert run_program("print('MARKER-1234')", success_marker="MARKER-1234").status == "passed"


def test_missing_namespaces_fail_loudly(monkeypatch):
    monkeypatch.setattr(sandbox, "UNSHARE", "/nonexistent/unshare")
    with pytest.raises(SandboxUnavailable):
        run_program("print('never runs uncontained')")
