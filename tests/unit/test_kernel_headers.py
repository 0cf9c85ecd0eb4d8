"""scripts/kernel-headers (the kernel-header step of scripts/setup) on fake trees and a fake apt.

Each test builds a host's state under ``tmp_path``: the modules root (``MEMREC_MODULES_ROOT``), the
``/usr/src`` root (``MEMREC_SRC_ROOT``), an os-release file, and apt-get/apt-cache/dpkg/dpkg-query
on PATH that install "packages" by running a small script that makes their folders (and, for a
kernel's own headers package, its links, as Debian's packages do). The real script then runs as
scripts/setup runs it, and ``memrec doctor``'s header check must say what the script did.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from memrec.commands.doctor import check_headers

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "kernel-headers"
RELEASE = os.uname().release

# The fake tools. State lives in $FAKE_APT: available/PKG (what installing PKG runs),
# available/PKG.depends, installed/PKG, owned (paths a package owns), updated, stale, fail, log.
FAKE_TOOLS = {
    "apt-get": r"""#!/bin/bash
echo "apt-get $*" >> "$FAKE_APT/log"
usable() { [ ! -e "$FAKE_APT/stale" ] || [ -e "$FAKE_APT/updated" ]; }
case "$1" in
  update) touch "$FAKE_APT/updated"; echo "Hit:1 fake"; exit 0 ;;
  install)
    shift
    for p in "$@"; do
      [ "$p" = -y ] && continue
      if [ -e "$FAKE_APT/fail" ] || ! usable || [ ! -e "$FAKE_APT/available/$p" ]; then
        echo "E: Unable to locate package $p"; exit 100
      fi
      bash "$FAKE_APT/available/$p" && touch "$FAKE_APT/installed/$p"
    done ;;
esac
""",
    "apt-cache": r"""#!/bin/bash
usable() { [ ! -e "$FAKE_APT/stale" ] || [ -e "$FAKE_APT/updated" ]; }
[ "$1" = madison ] && usable && [ -e "$FAKE_APT/available/$2" ] && echo "$2 | 1.0 | fake"
exit 0
""",
    "dpkg": r"""#!/bin/bash
case "$1" in
  --print-architecture) echo amd64 ;;
  -S) grep -qxF "$2" "$FAKE_APT/owned" 2>/dev/null && echo "fake-package: $2" && exit 0; exit 1 ;;
esac
""",
    "dpkg-query": r"""#!/bin/bash
fmt=$2; p=$3
[ -e "$FAKE_APT/available/$p" ] || [ -e "$FAKE_APT/installed/$p" ] || exit 1
case "$fmt" in
  *Status*) [ -e "$FAKE_APT/installed/$p" ] && printf 'install ok installed' || printf 'unknown ok not-installed' ;;
  *Depends*) cat "$FAKE_APT/available/$p.depends" 2>/dev/null ;;
esac
""",
}


class Host:
    """A fake host's trees and apt; ``run()`` runs the real script against them."""

    def __init__(self, tmp: Path, distro: str = "debian") -> None:
        self.modules = tmp / "modules"
        self.src = tmp / "src"
        self.apt = tmp / "apt"
        self.bin = tmp / "bin"
        for d in (self.modules, self.src, self.apt / "available", self.apt / "installed", self.bin):
            d.mkdir(parents=True)
        self.os_release = tmp / "os-release"
        self.os_release.write_text(f"ID={distro}\nPRETTY_NAME={distro}\n")
        for name, text in FAKE_TOOLS.items():
            (self.bin / name).write_text(text)
            (self.bin / name).chmod(0o755)

    def package(self, name: str, makes: list[str], depends: str = "", links: bool = False) -> None:
        """Make ``name`` installable: it creates ``makes`` (folders under src, each with include/)."""
        lines = [f"mkdir -p {self.src / d / 'include'}" for d in makes]
        if links:  # a kernel's own package ships /lib/modules/<release>/build and source
            build = self.modules / RELEASE / "build"
            lines += [f"mkdir -p {self.modules / RELEASE}", f"ln -sfn {self.src / makes[0]} {build}",
                      f"ln -sfn {self.src / makes[-1]} {self.modules / RELEASE / 'source'}",
                      f"echo {build} >> {self.apt / 'owned'}"]
        (self.apt / "available" / name).write_text("\n".join(lines) + "\n")
        if depends:
            (self.apt / "available" / f"{name}.depends").write_text(depends)

    def tree(self, name: str) -> Path:
        (self.src / name / "include").mkdir(parents=True)
        return self.src / name

    def run(self, *args: str) -> subprocess.CompletedProcess:
        env = dict(
            os.environ,
            PATH=f"{self.bin}:{os.environ['PATH']}",
            FAKE_APT=str(self.apt),
            MEMREC_MODULES_ROOT=str(self.modules),
            MEMREC_SRC_ROOT=str(self.src),
            MEMREC_OS_RELEASE=str(self.os_release),
        )
        env.pop("MEMREC_SETUP_LOG", None)
        env.pop("MEMREC_APT_UPDATED", None)
        return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)

    def link(self, name: str) -> str | None:
        path = self.modules / RELEASE / name
        return os.readlink(path) if path.is_symlink() else None

    def apt_calls(self) -> list[str]:
        log = self.apt / "log"
        return log.read_text().splitlines() if log.exists() else []

    def doctor(self):
        return check_headers(RELEASE, modules=self.modules)


def debian_meta(host: Host, abi: str = "6.1.0-57") -> None:
    host.package("linux-headers-amd64", [f"linux-headers-{abi}-amd64", f"linux-headers-{abi}-common"],
                 depends=f"linux-headers-{abi}-amd64 (= 6.1.192-3)")


def test_fresh_debian_host_without_a_kernel_package_falls_back_and_doctor_agrees(tmp_path):
    # GIVEN a fresh Debian host: an empty modules root, nothing under /usr/src, no -generic trees
    host = Host(tmp_path)
    debian_meta(host)
    # WHEN the set-up's header step runs
    result = host.run()
    # THEN it falls back to Debian's headers, links them, and says so in one line each
    assert result.returncode == 0, result.stderr
    assert f"no headers package for kernel {RELEASE}: falling back to the distribution's linux-headers-amd64" in result.stderr
    assert host.link("build") == str(host.src / "linux-headers-6.1.0-57-amd64")
    assert host.link("source") == str(host.src / "linux-headers-6.1.0-57-common")
    assert "apt-get install -y linux-headers-amd64" in host.apt_calls()
    assert "E: Unable" not in result.stderr and "Hit:" not in result.stderr  # apt's output is in the log only
    check = host.doctor()
    assert check.status == "warn" and "fallback" in check.detail and "linux-headers-6.1.0-57-amd64" in check.detail


def test_apt_lists_never_updated_are_updated_before_installing(tmp_path):
    # GIVEN a host whose apt lists were never fetched (apt knows no package until `apt-get update`)
    host = Host(tmp_path)
    debian_meta(host)
    (host.apt / "stale").touch()
    # WHEN
    result = host.run()
    # THEN the lists are updated once, then the headers installed
    assert result.returncode == 0, result.stderr
    calls = host.apt_calls()
    assert calls.count("apt-get update") == 1
    assert calls.index("apt-get update") < calls.index("apt-get install -y linux-headers-amd64")


def test_ubuntu_links_the_generic_tree_and_its_common_half(tmp_path):
    # GIVEN an Ubuntu host whose kernel has no headers package
    host = Host(tmp_path, distro="ubuntu")
    host.package("linux-headers-generic", ["linux-headers-6.8.0-49-generic", "linux-headers-6.8.0-49"],
                 depends="linux-headers-6.8.0-49-generic")
    # WHEN
    result = host.run()
    # THEN Ubuntu's meta package and its -generic tree are used (no Debian -amd64 glob involved)
    assert result.returncode == 0, result.stderr
    assert "falling back to the distribution's linux-headers-generic" in result.stderr
    assert host.link("build") == str(host.src / "linux-headers-6.8.0-49-generic")
    assert host.link("source") == str(host.src / "linux-headers-6.8.0-49")


def test_a_kernel_with_its_own_package_gets_it_and_forget_leaves_the_package_links(tmp_path):
    # GIVEN apt has the running kernel's own headers package (which ships the build link)
    host = Host(tmp_path)
    host.package(f"linux-headers-{RELEASE}", [f"linux-headers-{RELEASE}", "linux-headers-x-common"], links=True)
    debian_meta(host)
    # WHEN
    result = host.run()
    # THEN that package is installed, not the fallback, and doctor calls them the kernel's own
    assert result.returncode == 0, result.stderr
    assert f"installing linux-headers-{RELEASE}" in result.stderr
    assert "falling back" not in result.stderr
    assert not (host.apt / "installed" / "linux-headers-amd64").exists()
    assert host.doctor().status == "ok"
    # AND --forget (CI's reset) keeps links that a package owns
    assert host.run("--forget").returncode == 0
    assert host.link("build") == str(host.src / f"linux-headers-{RELEASE}")


def test_own_headers_installed_but_unlinked_are_linked_without_apt(tmp_path):
    # GIVEN the kernel's own headers are unpacked under /usr/src but build is missing
    host = Host(tmp_path)
    own = host.tree(f"linux-headers-{RELEASE}")
    # WHEN
    result = host.run()
    # THEN they are linked, and apt is not asked for anything
    assert result.returncode == 0, result.stderr
    assert host.link("build") == str(own)
    assert not any(c.startswith("apt-get install") for c in host.apt_calls())
    assert host.doctor().status == "ok"


def test_rerun_changes_nothing_and_forget_returns_to_the_fresh_host_path(tmp_path):
    # GIVEN a host set up once with the fallback
    host = Host(tmp_path)
    debian_meta(host)
    assert host.run().returncode == 0
    calls = len(host.apt_calls())
    # WHEN it runs again
    again = host.run()
    # THEN it prints nothing and calls no apt
    assert again.returncode == 0 and again.stderr == ""
    assert len(host.apt_calls()) == calls
    # WHEN CI forgets the links the set-up made
    forget = host.run("--forget")
    # THEN both are gone (and said), and the next run makes them again without reinstalling
    assert forget.returncode == 0
    assert forget.stderr.count("removing") == 2
    assert host.link("build") is None and host.link("source") is None
    assert host.doctor().status == "fail"
    redo = host.run()
    assert redo.returncode == 0, redo.stderr
    assert host.link("build") == str(host.src / "linux-headers-6.1.0-57-amd64")
    assert [c for c in host.apt_calls()[calls:] if c.startswith("apt-get install")] == []


def test_forget_leaves_links_that_point_outside_the_src_root(tmp_path):
    # GIVEN a build link a user made by hand to somewhere else
    host = Host(tmp_path)
    (host.modules / RELEASE).mkdir()
    elsewhere = tmp_path / "my-headers"
    (elsewhere / "include").mkdir(parents=True)
    (host.modules / RELEASE / "build").symlink_to(elsewhere)
    # WHEN / THEN
    assert host.run("--forget").returncode == 0
    assert host.link("build") == str(elsewhere)


def test_without_the_meta_dependency_the_newest_plain_flavour_tree_is_taken(tmp_path):
    # GIVEN the meta package installed with no readable dependency, and -cloud/-rt trees beside
    host = Host(tmp_path)
    host.package("linux-headers-amd64", [])
    for name in ("linux-headers-6.1.0-50-amd64", "linux-headers-6.1.0-57-amd64", "linux-headers-6.1.0-58-cloud-amd64",
                 "linux-headers-6.1.0-59-rt-amd64", "linux-headers-6.1.0-57-common"):
        host.tree(name)
    # WHEN
    result = host.run()
    # THEN the newest plain -amd64 tree
    assert result.returncode == 0, result.stderr
    assert host.link("build") == str(host.src / "linux-headers-6.1.0-57-amd64")
    assert host.link("source") == str(host.src / "linux-headers-6.1.0-57-common")


@pytest.mark.parametrize("case", ["apt fails", "no tree after install"])
def test_failures_say_what_failed_with_the_log_tail(tmp_path, case):
    # GIVEN apt that cannot install, or a meta package that leaves no headers tree
    host = Host(tmp_path)
    if case == "apt fails":
        debian_meta(host)
        (host.apt / "fail").touch()
    else:
        host.package("linux-headers-amd64", [])
    # WHEN
    result = host.run()
    # THEN exit 69 with one line saying what failed (and apt's own words, from the log)
    assert result.returncode == 69
    if case == "apt fails":
        assert "apt-get install linux-headers-amd64 failed" in result.stderr
        assert "| E: Unable to locate package linux-headers-amd64" in result.stderr
        assert "the whole log:" in result.stderr
    else:
        assert "no amd64 headers found under" in result.stderr
    assert host.link("build") is None
