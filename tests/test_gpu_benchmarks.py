"""scripts/gpu_benchmarks.sh, without a GPU: it refuses what it does not know before starting
anything, every flag its sections give a benchmark is one that benchmark takes, and a run packs each
section's log and output folder into one tarball even when the sections fail."""
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_benchmarks.sh"


def run(*args, **env):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, env={**os.environ, **env})


def sections() -> list:
    listed = run("--list")
    assert listed.returncode == 0, listed.stderr
    return listed.stdout.split()


def test_an_unknown_section_exits_2_and_lists_the_sections():
    refused = run("kernel_b1", "no_such_section")
    assert refused.returncode == 2
    assert "no_such_section" in refused.stderr
    assert all(name in refused.stderr for name in sections())
    assert run("--no-such-flag").returncode == 2


def test_a_prefix_names_every_section_it_begins_and_an_exact_name_only_itself():
    names = sections()
    tests = [n for n in names if n.startswith("tests_")]
    assert tests
    printed = run("--print", "tests").stdout
    assert all(re.search(rf"^{n} \(\)", printed, re.M) for n in tests)
    exact = [n for n in names if any(other.startswith(n + "_") for other in names)]  # e.g. prune beside prune_1m
    for name in exact:
        assert re.findall(r"^(\w+) \(\)", run("--print", name).stdout, re.M) == [name]


def test_every_benchmark_flag_a_section_passes_is_one_its_script_takes():
    printed = run("--print", *sections())
    assert printed.returncode == 0, printed.stderr
    flags = {}  # script -> the flags the sections give it
    for script, arguments in re.findall(r"scripts/(\w+)\.py([^;\n]*)", printed.stdout):
        flags.setdefault(script, set()).update(re.findall(r"(?<!\S)(--[\w-]+)", arguments))
    assert {"bench_kernel", "bench_decode", "bench_prune", "bench_attention"} <= set(flags)
    for script, used in flags.items():
        help_text = subprocess.run([sys.executable, str(REPO / "scripts" / f"{script}.py"), "--help"],
                                   capture_output=True, text=True, cwd=REPO).stdout
        taken = {word.rstrip(",") for word in help_text.split()}
        assert used <= taken, f"{script}.py takes no {sorted(used - taken)}"


def test_a_run_packs_every_section_into_one_tarball_even_when_they_fail(tmp_path):
    done = run("kernel_b1", "prune", PYTHON="false", OUT=str(tmp_path), SECTION_LIMIT_S="60")  # every command fails
    assert done.returncode == 0, done.stderr
    with tarfile.open(tmp_path / "results.tgz") as tar:
        packed = set(tar.getnames())
    assert {"environment.txt", "kernel_b1.log", "prune.log", "kernel_b1", "prune"} <= packed
    assert "prune: exit 1 after" in (tmp_path / "prune.log").read_text()
    assert "=== kernel_b1" in done.stdout and "=== prune" in done.stdout


def test_a_tensor_parallel_section_sees_two_gpus_and_the_others_one(tmp_path):
    done = run("tp70b_dense_tp2_b1", "tp70b_2of4_b1", PYTHON="false", OUT=str(tmp_path), SECTION_LIMIT_S="60")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "tp70b_dense_tp2_b1.log").read_text().startswith("[gpu 0,1] tp70b_dense_tp2_b1")
    assert (tmp_path / "tp70b_2of4_b1.log").read_text().startswith("[gpu 0] tp70b_2of4_b1")


def fake_python(tmp_path) -> Path:
    """A PYTHON for the script: pip and -c run the real interpreter; a section's benchmark instead
    reports whether the wheel's module imports."""
    path = tmp_path / "python"
    path.write_text(f"""#!/usr/bin/env bash
if [[ $1 == -m && $2 == pip || $1 == -c ]]; then exec {sys.executable} "$@"; fi
exec {sys.executable} -c "import wheel_probe; print('imported', wheel_probe.VALUE)"
""")
    path.chmod(0o755)
    return path


def test_wheels_are_installed_for_the_sections_and_a_folder_without_them_exits_2(tmp_path):
    import zipfile
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "wheel_probe-1.0-py3-none-any.whl", "w") as wheel:
        info = "wheel_probe-1.0.dist-info"
        wheel.writestr("wheel_probe.py", "VALUE = 42\n")
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: wheel-probe\nVersion: 1.0\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")
    python = str(fake_python(tmp_path))
    done = run("attention", PYTHON=python, OUT=str(tmp_path / "out"), SECTION_LIMIT_S="60", WHEELS=str(wheels))
    assert done.returncode == 0, done.stderr
    assert "imported 42" in (tmp_path / "out" / "attention.log").read_text()

    empty = tmp_path / "empty"
    empty.mkdir()
    refused = run("attention", PYTHON=python, OUT=str(tmp_path / "out2"), WHEELS=str(empty))
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == f"WHEELS={empty}: the wheels did not install"
    assert not (tmp_path / "out2" / "attention.log").exists()
