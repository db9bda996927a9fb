"""Run model-written Python contained: Linux namespaces, an unprivileged uid and rlimits.

Nothing model-written ever runs in this process. `run_program` starts util-linux `unshare` (present
on every Debian/Ubuntu machine) as root, which creates new PID, mount, network, IPC and UTS namespaces
and forks a small init (this file, run with `python -I -S`). The init, PID 1 of the new PID namespace:

- covers /tmp, /var/tmp, /run and /dev/shm with empty tmpfs, then remounts every mount read-only and
  nosuid (in its private mount namespace; the host's mounts are untouched),
- mounts a fresh size-limited tmpfs (`max_file_mb`) on the program's working directory, the only
  writable place; it lives in the namespace and disappears with it (HOME and TMPDIR point there),
- makes the interpreter reachable when one of its parent folders is closed to other users (a pyenv
  under /root): a tmpfs over that folder with only the needed subfolder bind-mounted back,
- forks the program as a fresh unprivileged uid (random per run, not in /etc/passwd; no groups, no
  capabilities, no_new_privs) with rlimits: RLIMIT_AS (`memory_mb`), RLIMIT_CPU (timeout + 1 s),
  RLIMIT_FSIZE (`max_file_mb`), RLIMIT_CORE 0, RLIMIT_NPROC (`max_processes`: processes and threads
  of that uid; enforced because the uid is not root and is used by this run only),
- waits for the program, reports its exit status on a private pipe, and exits: when PID 1 of a PID
  namespace exits the kernel kills every process left in it (setsid or double-forked children too)
  before its parent `unshare` sees it exit.

So the program has no network (the new network namespace has only a loopback that is down), cannot
write outside its own temporary directory, cannot exceed the process count, and every descendant is
dead when `run_program` returns. The parent reads stdout and stderr itself with a byte cap
(`max_output_mb`, both streams together; only a tail is kept) and one wall-clock deadline; on either
it SIGKILLs the namespace's init and waits for `unshare` to exit, which happens only after the
namespace is empty. An optional `success_marker`: "passed" then also needs stdout's last line to be
exactly that string (evaluation.code_tasks prints a per-run random token after the tests, so a
program that exits 0 before them, by sys.exit/os._exit/SystemExit, fails).

If namespaces cannot be created (not root, no unshare), `run_program` raises SandboxUnavailable with
one line; there is no uncontained fallback.

Not contained: reading files the unprivileged uid may read (the filesystem is visible read-only),
host unix sockets outside the covered folders whose permissions let any user connect, and total memory
beyond RLIMIT_AS per process x RLIMIT_NPROC (no cgroup). A program can still forge its own result
(read the marker from its source, patch unittest): the tests run in its process, so the marker stops
accidental early exits, not a hostile program. Timing: about 0.1 s of overhead per program.

CLI: python -m evaluation.sandbox program.py [--timeout 10] [--memory_mb 1024]
"""
import json
import os
import re
import resource
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

OUTPUT_TAIL_CHARS = 2000  # keep enough of stderr to see the failing assert, not a whole log
INIT_FLAG = "--sandbox-init"  # argv[1] of the in-namespace init (internal)
UNSHARE = "unshare"
UNSHARE_ARGS = ["--pid", "--fork", "--kill-child", "--mount-proc", "--net", "--ipc", "--uts"]
COVERED = ["/tmp", "/var/tmp", "/run", "/dev/shm"]  # hidden behind empty tmpfs (host temp files, sockets)


class SandboxUnavailable(RuntimeError):
    """Namespaces could not be created here; nothing was run."""


@dataclass
class SandboxResult:
    status: str  # "passed", "failed", "timeout", "memory" or "output" (over the output cap)
    returncode: int | None  # the program's exit code, or -signal; None when the sandbox killed it
    stdout: str
    stderr: str

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def run_program(source: str, timeout: float = 10.0, memory_mb: int = 1024, max_file_mb: int = 64,
                max_processes: int = 32, max_output_mb: float = 4, success_marker: str | None = None) -> SandboxResult:
    """Run `source` as a Python program in the sandbox. "passed": exit status 0 within the limits and,
    with `success_marker`, that string as the last line of stdout."""
    workdir = tempfile.mkdtemp(prefix="sandbox-")
    try:
        with open(os.path.join(workdir, "program.py"), "w", encoding="utf-8") as f:
            f.write(source)
        uid = 1_000_000 + secrets.randbelow(1 << 30)  # a fresh uid: RLIMIT_NPROC counts this run only
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": workdir, "TMPDIR": workdir,
               "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        limits = {"AS": memory_mb << 20, "CPU": int(timeout) + 1, "FSIZE": max_file_mb << 20, "CORE": 0,
                  "NPROC": max_processes}
        status_r, status_w = os.pipe()
        config = {"workdir": workdir, "uid": uid, "env": env, "limits": limits, "disk_mb": max_file_mb,
                  "python": sys.executable, "status_fd": status_w, "expose": _interpreter_paths()}
        command = [UNSHARE, *UNSHARE_ARGS, "--", sys.executable, "-I", "-S", os.path.abspath(__file__),
                   INIT_FLAG, json.dumps(config)]
        try:
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, pass_fds=(status_w,), start_new_session=True)
        except FileNotFoundError:
            os.close(status_r)
            raise SandboxUnavailable("evaluation.sandbox needs util-linux `unshare` "
                                     "(apt-get install util-linux)") from None
        finally:
            os.close(status_w)
        try:
            outcome, stdout, stderr, status = _collect(process, status_r, timeout, int(max_output_mb * (1 << 20)))
        finally:
            _kill(process)
            os.close(status_r)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    stdout, stderr = _tail(stdout), _tail(stderr)
    if outcome:
        return SandboxResult(outcome, None, stdout, stderr)
    if not status:  # the init never started the program: namespaces or mounts failed
        reason = stderr.strip().splitlines()[-1:] or [f"unshare exited with {process.returncode}"]
        raise SandboxUnavailable(f"evaluation.sandbox could not contain the program (needs root and "
                                 f"Linux namespaces): {reason[0]}")
    kind, value = status.split()
    returncode = int(value) if kind == "exit" else -int(value)
    if returncode == 0:
        if success_marker is None or stdout.rstrip("\n").rsplit("\n", 1)[-1] == success_marker:
            return SandboxResult("passed", 0, stdout, stderr)
        return SandboxResult("failed", 0, stdout, stderr + "\nsandbox: exited 0 before the success marker")
    if returncode == -signal.SIGXCPU:
        return SandboxResult("timeout", returncode, stdout, stderr)
    # Under RLIMIT_AS an allocation fails: Python raises MemoryError, C code may die on SIGSEGV/SIGKILL.
    if "MemoryError" in stderr or returncode in (-signal.SIGKILL, -signal.SIGSEGV):
        return SandboxResult("memory", returncode, stdout, stderr)
    return SandboxResult("failed", returncode, stdout, stderr)


def _collect(process, status_fd, timeout, max_output):
    """Reads stdout, stderr and the init's status report until all three close (the namespace is empty),
    the deadline passes or the output passes the cap. Returns (outcome or None, stdout, stderr, status)."""
    deadline = time.monotonic() + timeout
    buffers = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray(), status_fd: bytearray()}
    keep = 4 * OUTPUT_TAIL_CHARS + 4096
    total, outcome = 0, None
    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map() and outcome is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                outcome = "timeout"
                break
            for key, _ in selector.select(remaining):
                data = os.read(key.fd, 1 << 16)
                if not data:
                    selector.unregister(key.fd)
                    continue
                buffer = buffers[key.fd]
                buffer += data
                del buffer[:-keep]
                if key.fd != status_fd:
                    total += len(data)
                    if total > max_output:
                        outcome = "output"
    if outcome:
        _kill(process)
    else:
        process.wait()
    return (outcome, bytes(buffers[process.stdout.fileno()]), bytes(buffers[process.stderr.fileno()]),
            buffers[status_fd].decode().strip())


def _kill(process: subprocess.Popen):
    """SIGKILL the namespace's init; `unshare` exits only after the kernel has emptied the namespace."""
    if process.poll() is not None:
        return
    for pid in _children(process.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:  # no init found: unshare's --kill-child takes it down
        process.kill()
        process.wait()


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:  # kernels without CONFIG_PROC_CHILDREN
        found = []
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
        return found


def _interpreter_paths() -> list[str]:
    import sysconfig

    paths = {os.path.realpath(sys.executable), sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}
    paths.update(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib"))
    paths.update(p for p in sys.path if os.path.isabs(p) and os.path.isdir(p))
    return sorted(os.path.realpath(p) for p in paths if os.path.exists(p))


def _tail(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")[-OUTPUT_TAIL_CHARS:]


# ---- inside the namespaces (PID 1, root) ----

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MS_STRICTATIME = 1024, 2048, 1 << 21, 1 << 24
MOUNT_OPTIONS = {"nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME, "nodiratime": MS_NODIRATIME,
                 "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}


def _mount(source, target, fstype, flags, data=None):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    encode = lambda s: None if s is None else s.encode()  # noqa: E731
    if libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {target}: {os.strerror(errno)}")


def _expose(paths):
    """Make each path reachable for any uid: a folder on the way that others cannot enter is covered by
    a tmpfs holding only the needed entries, bind-mounted back from the original."""
    depth = 1
    while True:
        groups = {}
        for path in paths:
            parts = path.split("/")
            if len(parts) > depth:
                folder = "/".join(parts[:depth]) or "/"
                if not os.stat(folder).st_mode & 0o001:
                    groups.setdefault(folder, set()).add(parts[depth])
        if not any(len(p.split("/")) > depth for p in paths):
            return
        for folder, names in groups.items():
            handles = {name: os.open(os.path.join(folder, name), os.O_PATH) for name in names}
            _mount("tmpfs", folder, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=64k")
            for name, handle in handles.items():
                target = os.path.join(folder, name)
                if os.path.isdir(f"/proc/self/fd/{handle}"):
                    os.mkdir(target)
                else:
                    open(target, "w").close()
                _mount(f"/proc/self/fd/{handle}", target, None, MS_BIND | MS_REC)
                os.close(handle)
        depth += 1


def _remount_everything_read_only():
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:
        target = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])  # mountinfo writes " " as \040
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
        for option in fields[5].split(","):
            flags |= MOUNT_OPTIONS.get(option, 0)
        try:
            _mount(None, target, None, flags)
        except OSError as e:
            if e.errno not in (2, 13):  # a mount hidden under another one is unreachable anyway
                raise


def _init(config):
    workdir, uid = config["workdir"], config["uid"]
    with open(os.path.join(workdir, "program.py"), "rb") as f:
        source = f.read()
    for path in COVERED:  # (not one that holds the interpreter, e.g. a venv under /tmp)
        if os.path.isdir(path) and not os.path.islink(path) and not any(
                p == path or p.startswith(path + "/") for p in config["expose"]):
            _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=64k")
    os.makedirs(workdir, exist_ok=True)  # a mount point inside the fresh /tmp
    _expose(config["expose"] + [workdir])
    _remount_everything_read_only()
    _mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, f"size={config['disk_mb']}m,mode=700,uid={uid},gid={uid}")
    with open(os.path.join(workdir, "program.py"), "wb") as f:
        f.write(source)
    status_fd = config["status_fd"]
    os.set_inheritable(status_fd, False)
    pid = os.fork()
    if pid == 0:
        try:
            for name, value in config["limits"].items():
                resource.setrlimit(getattr(resource, f"RLIMIT_{name}"), (value, value))
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            import ctypes
            if ctypes.CDLL(None).prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
                raise OSError("prctl(PR_SET_NO_NEW_PRIVS) failed")
            os.chdir(workdir)
            python = config["python"]
            os.execve(python, [python, "-I", "program.py"], config["env"])
        except BaseException as e:  # noqa: BLE001 - report and never fall through to the init's code
            print(f"sandbox: could not start the program: {e}", file=sys.stderr)
        os._exit(127)
    while True:  # PID 1 reaps orphans too; it leaves when the program itself exits
        child, status = os.wait()
        if child == pid:
            break
    code = os.waitstatus_to_exitcode(status)
    os.write(status_fd, f"exit {code}\n".encode() if code >= 0 else f"signal {-code}\n".encode())
    os._exit(0)  # the kernel now kills everything left in the namespace


def main():
    if sys.argv[1:2] == [INIT_FLAG]:
        try:
            _init(json.loads(sys.argv[2]))
        except Exception as e:  # noqa: BLE001 - one line for the parent's SandboxUnavailable
            print(f"sandbox setup failed: {e}", file=sys.stderr)
            os._exit(125)
    import cli_args  # not at the top: the init above runs this file without the repository on sys.path

    parser = cli_args.ArgumentParser(description="Run a Python file in the evaluation sandbox.")
    parser.add_argument("program", help="Python source file to run")
    parser.add_argument("--timeout", type=cli_args.positive_float, default=10.0, help="wall-clock seconds")
    parser.add_argument("--memory_mb", type=cli_args.positive_int, default=1024, help="address-space limit")
    args = parser.parse_args()
    try:
        with open(args.program, encoding="utf-8") as f:
            source = f.read()
    except OSError as e:
        sys.exit(f"error: cannot read {args.program}: {e.strerror}")
    try:
        result = run_program(source, args.timeout, args.memory_mb)
    except SandboxUnavailable as e:
        sys.exit(f"error: {e}")
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    print(f"sandbox: {result.status} (exit code {result.returncode})", file=sys.stderr)
    sys.exit(0 if result.passed else 1)


if __name__ == "__main__":
    main()
