"""``memrec doctor``: is this host able to record, and if not, what to do about it."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import textwrap
from pathlib import Path

from memrec.base.errors import ExitCode

CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
CAP_BPF = 39


def _effective_caps(status_text: str) -> int:
    for line in status_text.splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def check_privileges(uid: int | None = None, status_text: str | None = None):
    """Root, or CAP_BPF + CAP_PERFMON (or CAP_SYS_ADMIN), is needed to load and attach probes."""
    from memrec.probes.health import Check

    uid = os.geteuid() if uid is None else uid
    if uid == 0:
        return Check("privileges", "ok", "running as root")
    caps = _effective_caps(status_text if status_text is not None else Path("/proc/self/status").read_text())
    if caps >> CAP_SYS_ADMIN & 1 or (caps >> CAP_BPF & 1 and caps >> CAP_PERFMON & 1):
        return Check("privileges", "ok", "CAP_BPF and CAP_PERFMON (or CAP_SYS_ADMIN) held")
    return Check(
        "privileges",
        "fail",
        f"uid {uid} without CAP_BPF+CAP_PERFMON",
        "run as root (sudo memrec ...), or grant cap_bpf,cap_perfmon+ep",
    )


def check_tracefs(root: Path = Path("/sys/kernel/tracing")):
    """uprobes are created and removed through tracefs' uprobe_events."""
    from memrec.probes.health import Check

    present = _present(root / "uprobe_events")
    if present:
        return Check("tracefs", "ok", f"{root}/uprobe_events present")
    if _present(Path("/sys/kernel/debug/tracing") / "uprobe_events"):
        return Check("tracefs", "ok", "/sys/kernel/debug/tracing/uprobe_events present")
    if present is None:
        return Check("tracefs", "warn", f"uid {os.geteuid()} may not look inside {root} (root's alone)",
                     "run memrec doctor as root to check it")
    return Check(
        "tracefs",
        "fail",
        f"no uprobe_events under {root}",
        f"mount -t tracefs nodev {root} (needs CONFIG_UPROBE_EVENTS)",
    )


def _present(path: Path) -> bool | None:
    """Whether ``path`` exists; None when this user may not look (tracefs and debugfs are 0700)."""
    try:
        return path.exists()
    except PermissionError:
        return None


def check_headers(release: str | None = None, modules: Path = Path("/lib/modules")):
    """BCC compiles against /lib/modules/$(uname -r)/build; say whether they are the kernel's own."""
    from memrec.probes.health import Check

    release = release or os.uname().release
    build = modules / release / "build"
    if not (build / "include").exists():
        return Check(
            "kernel headers",
            "fail",
            f"{build} missing",
            f"apt-get install linux-headers-{release}, or run scripts/setup (it falls back to the "
            "distribution's headers for kernels without a package)",
        )
    target = os.path.realpath(build)
    if release in target:
        return Check("kernel headers", "ok", f"the running kernel's own ({target})")
    return Check(
        "kernel headers",
        "warn",
        f"fallback: {target} linked for kernel {release}, which has no headers package "
        "(fine for uprobes: they use only pt_regs and maps)",
    )


def named_but_missing(name: str, option: str, paths: list[str]):
    """The check ``name`` failing on the files named with ``option`` that are not there, else None.

    The finders skip such a path without a word, so the check would otherwise say "none found"
    (or "ok" without it) of a file the user named with a typo.
    """
    from memrec.probes.health import Check

    missing = [path for path in paths if not os.path.exists(path)]
    if not missing:
        return None
    return Check(name, "warn", f"{option} {', '.join(missing)}: no such file", f"name an existing file with {option}")


def check_libcuda(extra: list[str]):
    """Find every libcuda.so.1 the daemon would attach to."""
    from memrec.probes.health import Check
    from memrec.probes.libs import find_libcuda

    missing = named_but_missing("libcuda", "--libcuda", extra)
    if missing is not None:
        return missing
    libs = find_libcuda(extra)
    if not libs:
        return Check(
            "libcuda",
            "warn",
            "no libcuda.so.1 mapped or installed",
            "install the NVIDIA driver, or name one with --libcuda PATH (memrec demo uses a stub)",
        )
    return Check("libcuda", "ok", ", ".join(str(lib.path) for lib in libs))


def _importable_torch_lib() -> list[str]:
    """The libc10_cuda.so of the torch this Python would import (found, not imported)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return []
    return [os.path.join(folder, "lib", "libc10_cuda.so") for folder in spec.submodule_search_locations]


def check_torch(extra: list[str]):
    """Whether the PyTorch installs here carry the allocator probes ``memrec daemon --tensors`` reads."""
    from memrec.base.errors import one_line
    from memrec.probes.cuda import torch_sites
    from memrec.probes.health import Check
    from memrec.probes.libs import find_libc10_cuda
    from memrec.probes.usdt import read_probes

    missing = named_but_missing("tensor blocks", "--torch-lib", extra)
    if missing is not None:
        return missing
    libs = find_libc10_cuda([*extra, *_importable_torch_lib()])
    if not libs:
        return Check("tensor blocks", "ok", "no libc10_cuda.so mapped or importable here; `memrec daemon --tensors` "
                     "probes PyTorch when a process maps it")
    good, bad = [], []
    for lib in libs:
        try:
            fd = os.open(lib.path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                sites, problem = torch_sites(read_probes(fd))
            finally:
                os.close(fd)
        except (OSError, ValueError) as error:
            sites, problem = [], f"cannot read it: {one_line(error)}"
        if problem:
            bad.append(f"{lib.path}: {problem}")
        else:
            good.append(f"{lib.path} ({len(sites)} probe sites)")
    if bad:
        return Check("tensor blocks", "warn", "; ".join(bad + good),
                     "those processes get driver segments only; PyTorch 2.2 and later on x86-64 carry usable probes "
                     "(docs/probes.md lists the releases checked)")
    return Check("tensor blocks", "ok", "with `memrec daemon --tensors`: " + ", ".join(good))


def check_stacks():
    """Per CPython the host's processes run (this one included), whether ``memrec daemon --stacks``
    can read its stacks."""
    from memrec.probes.health import Check
    from memrec.probes.pystacks import SUPPORTED
    from memrec.probes.pystacks import locate

    found: dict[str, str] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            interp = locate(int(name))
        except OSError:
            continue
        if interp is not None and interp.path not in found:
            found[interp.path] = f"{interp.path} ({interp.label}): " + (interp.problem or "stacks readable")
    if not found:
        return Check("python stacks", "ok", f"no Python process readable here; --stacks reads CPython {SUPPORTED}")
    bad = [line for line in found.values() if not line.endswith("stacks readable")]
    if bad:
        return Check("python stacks", "warn", "; ".join(sorted(found.values())),
                     f"processes of those interpreters get \"stack unavailable (reason)\"; --stacks reads CPython {SUPPORTED}")
    return Check("python stacks", "ok", "with `memrec daemon --stacks`: " + "; ".join(sorted(found.values())))


class DoctorCommand:
    """Check this host: privileges, BPF, tracefs, bcc, kernel headers, libcuda, NVML.

    Prints one line per check and, for each failure, what to do about it. Exits 1 when a check
    that recording needs fails (warnings, such as no GPU, do not fail). Also says whether the
    daemon's compiled probe program for this kernel is cached (a start then skips the compile).
    """

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--libcuda", action="append", default=[], metavar="PATH", help="also look at this libcuda")
        parser.add_argument("--torch-lib", action="append", default=[], metavar="PATH",
                            help="also look at this libc10_cuda.so (PyTorch's allocator probes)")
        parser.add_argument("--probe-cache", default=None, metavar="DIR",
                            help="the daemon's compiled-program cache to look at (default: the daemon's default)")
        parser.add_argument("-j", "--json", action="store_true", help="print the checks as JSON")

    def run(self, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        from memrec.daemon.config import DEFAULT_PROBE_CACHE
        from memrec.daemon.config import DEFAULT_RINGBUF_PAGES
        from memrec.probes import health

        checks = [
            check_privileges(),
            check_tracefs(),
            check_headers(),
            health.check_bcc(),
            health.check_probe_cache(os.path.abspath(args.probe_cache or DEFAULT_PROBE_CACHE), DEFAULT_RINGBUF_PAGES),
            check_libcuda(args.libcuda),
            check_torch(args.torch_lib),
            check_stacks(),
            health.check_nvml(),
        ]
        if args.json:
            print(json.dumps([c.__dict__ for c in checks], indent=2))
        else:
            width = max(shutil.get_terminal_size((80, 24)).columns, 40)  # $COLUMNS, the terminal, else 80
            for c in checks:
                lines = [(f"{c.status.upper():4}  {c.name:15} ", c.detail)]
                if c.fix and c.status != "ok":
                    lines.append((f"      {'':15} ", f"-> {c.fix}"))
                for head, text in lines:  # wrapped under the detail's column, never cut
                    print("\n".join(textwrap.wrap(text, width, initial_indent=head, subsequent_indent=" " * len(head),
                                                  break_long_words=False, break_on_hyphens=False)))
        return ExitCode.ERROR if any(c.status == "fail" for c in checks) else ExitCode.OK
