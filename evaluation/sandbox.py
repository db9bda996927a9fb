"""Run model-written Python in a separate process, with a timeout and memory limit, in a temp folder.

Nothing model-written ever runs in this process. Each program gets:
- its own interpreter (`python -I`: isolated mode, no user site-packages, no PYTHON* env vars),
- a fresh temporary working directory that is deleted afterwards (HOME and TMPDIR point there too,
  so relative writes and tempfile land inside it),
- resource limits set in the child before exec: address space (memory), CPU seconds, file size,
  and no core dumps,
- its own process group, so a timeout kills the program together with anything it spawned.

This is containment against buggy code (infinite loops, memory hogs, stray files), as in the
HumanEval harness; it is not a security boundary against hostile code: an absolute path can still
be written. Run untrusted evaluations inside a container.

CLI: python -m evaluation.sandbox program.py [--timeout 10] [--memory_mb 1024]
"""
import argparse
import os
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

OUTPUT_TAIL_CHARS = 2000  # keep enough of stderr to see the failing assert, not a whole log


@dataclass
class SandboxResult:
    status: str  # "passed", "failed", "timeout" or "memory"
    returncode: int | None
    stdout: str
    stderr: str

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def _limit_resources(memory_bytes: int, cpu_seconds: int, file_bytes: int):
    """Returns the preexec_fn that sets the child's limits between fork and exec."""
    def apply():
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def run_program(source: str, timeout: float = 10.0, memory_mb: int = 1024, max_file_mb: int = 64) -> SandboxResult:
    """Run `source` as a Python program; "passed" means it exited with status 0 within the limits."""
    with tempfile.TemporaryDirectory(prefix="sandbox-") as workdir:
        program = os.path.join(workdir, "program.py")
        with open(program, "w", encoding="utf-8") as f:
            f.write(source)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": workdir, "TMPDIR": workdir,
               "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
        process = subprocess.Popen(
            [sys.executable, "-I", program], cwd=workdir, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            preexec_fn=_limit_resources(memory_mb << 20, int(timeout) + 1, max_file_mb << 20))
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            stdout, stderr = process.communicate()
            return SandboxResult("timeout", None, _tail(stdout), _tail(stderr))
        finally:
            _kill_group(process)  # children the program left behind die with it
    stdout, stderr = _tail(stdout), _tail(stderr)
    if process.returncode == 0:
        return SandboxResult("passed", 0, stdout, stderr)
    if process.returncode == -signal.SIGXCPU:
        return SandboxResult("timeout", process.returncode, stdout, stderr)
    # Under RLIMIT_AS an allocation fails: Python raises MemoryError, C code may die on SIGSEGV/SIGKILL.
    if "MemoryError" in stderr or process.returncode in (-signal.SIGKILL, -signal.SIGSEGV):
        return SandboxResult("memory", process.returncode, stdout, stderr)
    return SandboxResult("failed", process.returncode, stdout, stderr)


def _kill_group(process: subprocess.Popen):
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")[-OUTPUT_TAIL_CHARS:]


def main():
    parser = argparse.ArgumentParser(description="Run a Python file in the evaluation sandbox.")
    parser.add_argument("program", help="Python source file to run")
    parser.add_argument("--timeout", type=float, default=10.0, help="wall-clock seconds")
    parser.add_argument("--memory_mb", type=int, default=1024, help="address-space limit")
    args = parser.parse_args()
    try:
        with open(args.program, encoding="utf-8") as f:
            source = f.read()
    except OSError as e:
        sys.exit(f"error: cannot read {args.program}: {e.strerror}")
    result = run_program(source, args.timeout, args.memory_mb)
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    print(f"sandbox: {result.status} (exit code {result.returncode})", file=sys.stderr)
    sys.exit(0 if result.passed else 1)


if __name__ == "__main__":
    main()
