"""Building the native kernels (cpu_build.py): one compile per library however many ask at once, and the
background builds a cold start begins with."""

from __future__ import annotations

import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from pallas_kernels import cpu_build

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="needs a C++ compiler")


def source(folder: Path, name: str, body: str = "extern \"C\" int answer() { return 42; }\n") -> Path:
    path = folder / "src" / f"{name}.cc"
    path.parent.mkdir(exist_ok=True)
    path.write_text(body)
    return path


def count_compiles(monkeypatch) -> list[Path]:
    """The outputs of every compiler run from now on (cpu_build's subprocess.run, wrapped)."""
    runs, real = [], subprocess.run

    def counted(cmd, *args, **kwargs):
        runs.append(Path(cmd[cmd.index("-o") + 1]).name)
        return real(cmd, *args, **kwargs)

    monkeypatch.setattr(cpu_build.subprocess, "run", counted)
    return runs


def test_concurrent_builders_compile_once_and_agree(tmp_path, monkeypatch):
    runs = count_compiles(monkeypatch)
    src, cache = source(tmp_path, "one"), tmp_path / "cache"
    start, results = threading.Barrier(4), []

    def build():
        start.wait()
        results.append(cpu_build.build_library(src, cache))

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and len(set(results)) == 1 and results[0].exists()
    assert runs == [results[0].name]  # the others waited on the lock, then found the library
    assert cpu_build.build_library(src, cache) == results[0] and len(runs) == 1


def test_background_builds_run_in_order_and_survive_a_broken_source(tmp_path, monkeypatch):
    runs = count_compiles(monkeypatch)
    cache = tmp_path / "cache"
    good = [source(tmp_path, "first"), source(tmp_path, "second")]
    broken = source(tmp_path, "broken", "this is not C++\n")
    thread = cpu_build.build_in_background([good[0], broken, good[1]], cache)
    assert thread.daemon
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert [name.split("-")[0] for name in runs] == ["first", "broken", "second"]
    built = sorted(p.name.split("-")[0] for p in cache.glob("*.so"))
    assert built == ["first", "second"]
    # what a later load asks for is there: no compile
    assert cpu_build.build_library(good[1], cache).exists() and len(runs) == 3
    with pytest.raises(subprocess.CalledProcessError):  # the broken one fails where it is asked for
        cpu_build.build_library(broken, cache)
