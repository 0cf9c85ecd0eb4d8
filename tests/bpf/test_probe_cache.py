"""The compiled-program cache, from outside: a daemon's second start loads the program without
compiling it and records the same workload the same way; a broken or unsafe cache costs a warning
and a compile, never a start (root; real uprobes on the stub driver)."""

from __future__ import annotations

import collections
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from memrec.trace.reader import load_trace
from tests.bpf.test_daemon import DaemonProcess
from tests.bpf.test_daemon import run_workload
from tests.bpf.test_daemon import wait_for_events
from tests.bpf.test_daemon import workdir  # noqa: F401 (a fixture)

pytestmark = pytest.mark.bpf

#: Runs its command where bcc cannot compile anything: the kernel headers (/lib/modules) are an
#: empty tmpfs in a private mount namespace. A daemon that starts there did not compile.
NO_HEADERS = ("unshare", "-m", "sh", "-c", 'mount -t tmpfs none /lib/modules && exec "$@"', "no-headers")
#: A program that needs the kernel headers: proves that NO_HEADERS stops a compile.
NEEDS_HEADERS = "from bcc import BPF; BPF(text='#include <linux/sched.h>\\nint f(void *ctx) { return 0; }')"


@pytest.fixture
def cache_dir(workdir):  # noqa: F811 (the fixture)
    d = workdir / "cache"
    yield d
    shutil.rmtree(d, ignore_errors=True)


def start(workdir, stub_lib, output: str, cache: Path | str, prefix: tuple[str, ...] = ()) -> DaemonProcess:  # noqa: F811
    d = DaemonProcess(workdir, stub_lib, output=output, args=("--probe-cache", str(cache)), prefix=prefix)
    try:
        d.wait_ready()
    except BaseException:
        d.kill()
        raise
    return d


def record_basic(d: DaemonProcess, stub_lib: Path) -> collections.Counter:
    """Run the basic workload under ``d``, stop it; the (kind, api) counts of the workload's events."""
    facts = run_workload(stub_lib, "basic")
    wait_for_events(d.output, {facts["pid"]})
    assert d.stop() == 0, d.log()
    ev = load_trace(d.output).events
    mine = ev[ev["pid"] == facts["pid"]]
    return collections.Counter(zip(mine["kind"].tolist(), mine["api"].tolist()))


def cache_files(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.mrprobe"))


def test_second_start_loads_the_cached_program_without_compiling(workdir, stub_lib, cache_dir):  # noqa: F811
    # GIVEN a daemon's first start with an empty cache directory: it compiles and writes the cache
    cold = start(workdir, stub_lib, "cold.mrec", cache_dir)
    cold_counts = record_basic(cold, stub_lib)
    assert "compiled the probe program" in cold.log() and "probe program compiled (" in cold.log()
    (cached,) = cache_files(cache_dir)
    assert cached.stat().st_mode & 0o777 == 0o600 and cache_dir.stat().st_mode & 0o777 == 0o700
    # AND a namespace in which bcc cannot compile (no kernel headers)
    probe = subprocess.run([*NO_HEADERS, sys.executable, "-c", NEEDS_HEADERS], capture_output=True, text=True, timeout=120)
    assert probe.returncode != 0, "bcc compiled without kernel headers: the test would prove nothing"
    # WHEN the daemon starts again there
    warm = start(workdir, stub_lib, "warm.mrec", cache_dir, prefix=NO_HEADERS)
    warm_counts = record_basic(warm, stub_lib)
    # THEN it loaded the program from the cache and recorded the same events as the cold start
    log = warm.log()
    assert "loaded the compiled probe program from the cache" in log and "compiled the probe program" not in log, log
    assert "probe program from the cache (" in log
    assert warm_counts == cold_counts and sum(cold_counts.values()) > 10
    assert cache_files(cache_dir) == [cached]


def test_a_corrupt_or_truncated_cache_file_costs_a_warning_and_a_compile(workdir, stub_lib, cache_dir):  # noqa: F811
    from memrec.daemon.config import DEFAULT_RINGBUF_PAGES
    from memrec.probes.cuda import CudaProbes

    # GIVEN a cache written by a first load with the daemon's options, then cut in half
    CudaProbes(ringbuf_pages=DEFAULT_RINGBUF_PAGES, probe_cache=str(cache_dir)).load().close()
    (cached,) = cache_files(cache_dir)
    whole = cached.read_bytes()
    cached.write_bytes(whole[: len(whole) // 2])
    # WHEN the daemon starts with it
    d = start(workdir, stub_lib, "cut.mrec", cache_dir)
    counts = record_basic(d, stub_lib)
    # THEN one warning says why, the program is compiled, the events are recorded, the file rewritten
    log = d.log()
    assert log.count("not using the cached probe program") == 1 and "checksum mismatch" in log, log
    assert "compiled the probe program" in log
    assert counts[(1, 1)] >= 4  # the basic workload's cuMemAlloc_v2 calls (kind ALLOC, api 1)
    from memrec.probes.probecache import decode

    rewritten = decode(cached.stem, cached.read_bytes())  # whole again (the fds baked in differ per compile)
    assert rewritten.functions.keys() == decode(cached.stem, whole).functions.keys()


def test_a_program_the_verifier_refuses_is_compiled_again(stub_lib, cache_dir, caplog):
    from memrec.probes import probecache
    from memrec.probes.cuda import CudaProbes
    from memrec.probes.cuda import program_cflags
    from memrec.probes.cuda import program_source
    from memrec.probes.loader import Program

    # GIVEN a well-formed cache file whose first function returns an uninitialised register
    # (what a kernel with a stricter verifier than the one that compiled it would refuse)
    key = probecache.cache_key(program_source(), program_cflags(False, 1024))
    good = probecache.ProbeCache(str(cache_dir))
    CudaProbes(probe_cache=str(cache_dir)).load().close()
    program = good.read(key)
    name, (kind, _insns) = next(iter(program.functions.items()))
    bad = Program(program.license, program.kern_version, program.maps,
                  {**program.functions, name: (kind, b"\x95" + bytes(7))}, program.fds)
    good.write(key, bad)
    # WHEN the probes load
    caplog.set_level(logging.INFO, logger="memrec")
    p = CudaProbes(probe_cache=str(cache_dir)).load()
    p.close()
    # THEN the verifier's words are in one warning, the program was compiled and the cache repaired
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "verifier" in warnings[0] and "R0" in warnings[0], warnings
    assert p.loaded_from == "compiled"
    assert good.read(key).functions[name] == program.functions[name]


@pytest.mark.parametrize("unsafe", ["symlink", "group-writable", "not-root"])
def test_an_unsafe_cache_directory_is_not_used(stub_lib, workdir, caplog, unsafe):  # noqa: F811
    from memrec.probes.cuda import CudaProbes

    real = workdir / "real"
    real.mkdir(mode=0o700)
    cache = real
    if unsafe == "symlink":
        cache = workdir / "link"
        cache.symlink_to(real)
    elif unsafe == "group-writable":
        real.chmod(0o770)
    else:
        os.chown(real, 65534, 65534)
    caplog.set_level(logging.INFO, logger="memrec")
    for _ in range(2):
        p = CudaProbes(probe_cache=str(cache)).load()
        p.close()
        assert p.loaded_from == "compiled"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("not using the probe cache" in w for w in warnings), warnings
    assert list(real.iterdir()) == []


def test_other_options_compile_and_cache_their_own_program(stub_lib, cache_dir):
    from memrec.probes.cuda import CudaProbes

    loads = [("follow", dict(follow_tree=True)), ("ring", dict(ringbuf_pages=2048)), ("plain", {})]
    for _name, kwargs in loads:
        p = CudaProbes(probe_cache=str(cache_dir), **kwargs).load()
        p.close()
        assert p.loaded_from == "compiled"
    assert len(cache_files(cache_dir)) == 3
    for _name, kwargs in loads:
        p = CudaProbes(probe_cache=str(cache_dir), **kwargs).load()
        p.close()
        assert p.loaded_from == "cache"


def test_symbol_offsets_are_those_bcc_finds(stub_lib):
    from bcc import BPF

    from memrec.probes.elfsyms import function_offsets

    fd = os.open(stub_lib, os.O_RDONLY)
    try:
        mine = function_offsets(fd, b"cu")
    finally:
        os.close(fd)
    theirs = {}
    for name, _addr in BPF.get_user_functions_and_addresses(str(stub_lib).encode(), b"^cu"):
        theirs[name.decode()] = BPF._check_path_symbol(str(stub_lib).encode(), name, None, -1)[1]  # noqa: SLF001
    assert mine == theirs and len(mine) > 40


@pytest.mark.parametrize("links", [True, False], ids=["multi-uprobe links", "perf events"])
def test_both_ways_of_attaching_record_exactly(stub_lib, cache_dir, monkeypatch, links):
    from memrec.probes import bpfsys
    from memrec.probes.cuda import CudaProbes
    from tests.bpf.test_probes import assert_exact
    from tests.bpf.test_probes import record

    if links and not bpfsys.uprobe_multi_supported():
        pytest.skip(f"kernel {os.uname().release} has no multi-uprobe links (6.6)")
    # GIVEN probes attached as links (kernel >= 6.6) or, as on older kernels, as perf events
    monkeypatch.setattr(bpfsys, "uprobe_multi_supported", lambda release=None: links)
    p = CudaProbes(probe_cache=str(cache_dir)).load()
    try:
        p.attach_library(stub_lib)
        kinds = {os.readlink(f"/proc/self/fd/{fd}") for fd in p._uprobes}  # noqa: SLF001
        assert kinds == {"anon_inode:bpf_link" if links else "anon_inode:[perf_event]"}
        # WHEN the workload runs THEN every call is recorded exactly
        facts, events = record(p, stub_lib, "basic")
        assert_exact(events, facts)
    finally:
        p.close()
    # AND closing detached them all
    assert not p._uprobes  # noqa: SLF001


def test_a_kernel_that_refuses_links_gets_perf_events(stub_lib, cache_dir, monkeypatch, caplog):
    import errno

    from memrec.probes import bpfsys
    from memrec.probes.cuda import CudaProbes
    from tests.bpf.test_probes import assert_exact
    from tests.bpf.test_probes import record

    # GIVEN a kernel that says it has multi-uprobe links but refuses the first one
    def refuse(*args):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(bpfsys, "uprobe_multi_supported", lambda release=None: True)
    monkeypatch.setattr(bpfsys, "attach_uprobe_link", refuse)
    caplog.set_level(logging.INFO, logger="memrec")
    p = CudaProbes(probe_cache=str(cache_dir)).load()
    try:
        # WHEN the stub is attached
        report = p.attach_library(stub_lib)
        # THEN one warning, every symbol attached as perf events, and the workload recorded exactly
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "multi-uprobe links refused" in warnings[0], warnings
        assert not report.missing
        assert {os.readlink(f"/proc/self/fd/{fd}") for fd in p._uprobes} == {"anon_inode:[perf_event]"}  # noqa: SLF001
        facts, events = record(p, stub_lib, "basic")
        assert_exact(events, facts)
    finally:
        p.close()
