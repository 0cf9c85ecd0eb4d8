"""Compare memrec's uprobe file offsets (memrec.probes.elfsyms, numpy) with bcc's own resolver
(bcc_resolve_symname, what BPF.attach_uprobe(sym=...) attaches at) and, where readelf exists, with
readelf -Ws + -lW. Usage: python3 check_elfsyms.py LIB [PREFIX]"""
import os
import shutil
import subprocess
import sys
import time

from bcc import BPF

from memrec.probes.elfsyms import function_offsets

lib = sys.argv[1]
prefix = sys.argv[2].encode() if len(sys.argv) > 2 else b"cu"
try:
    from memrec.probes.cuda import SYMBOLS, UNTRACED_SYMBOLS
except Exception as exc:  # noqa: BLE001
    SYMBOLS, UNTRACED_SYMBOLS = (), ()
    print("cannot import SYMBOLS:", exc)
real = os.path.realpath(lib)
print(f"library {lib} -> {real}, {os.path.getsize(real)} bytes")
fd = os.open(lib, os.O_RDONLY)
t = time.perf_counter()
ours = function_offsets(fd, prefix)
print(f"memrec: {len(ours)} function symbols starting {prefix!r} in {time.perf_counter() - t:.3f} s")
os.close(fd)

probed = [s for s in SYMBOLS if s.encode().startswith(prefix)]
print(f"probed symbols: {len(probed)} (untraced set {len(UNTRACED_SYMBOLS)})")
missing = [s for s in probed if s not in ours]
print("probed but not found by memrec:", missing)

# bcc, for every probed symbol and for every prefix symbol memrec found
names = sorted(set(ours) | set(probed))
bcc = {}
t = time.perf_counter()
for name in names:
    try:
        bcc[name] = BPF._check_path_symbol(lib.encode(), name.encode(), None, -1)[1]
    except Exception as exc:  # noqa: BLE001
        bcc[name] = f"error: {exc}"
print(f"bcc resolved {len(names)} names in {time.perf_counter() - t:.2f} s")
mism = [(n, ours.get(n), bcc[n]) for n in names if ours.get(n) != bcc[n]]
mism_probed = [m for m in mism if m[0] in probed]
print(f"bcc vs memrec: {len(names) - len(mism)}/{len(names)} equal; mismatches {len(mism)} "
      f"(of them probed: {len(mism_probed)})")
for n, a, b in mism[:40]:
    print(f"  MISMATCH {n}: memrec {a if a is None else hex(a)}  bcc {b if isinstance(b, str) else hex(b)}")
for n in probed:
    o = ours.get(n)
    print(f"  probed {n}: memrec {hex(o) if o is not None else None} bcc "
          f"{bcc[n] if isinstance(bcc[n], str) else hex(bcc[n])}")

# readelf, independently
if shutil.which("readelf"):
    seg = []
    for line in subprocess.run(["readelf", "-lW", lib], capture_output=True, text=True).stdout.splitlines():
        f = line.split()
        if f and f[0] == "LOAD":
            off, vaddr, filesz = int(f[1], 16), int(f[2], 16), int(f[4], 16)
            seg.append((vaddr, vaddr + filesz, off))
    re_off = {}
    for line in subprocess.run(["readelf", "-Ws", "--dyn-syms", lib], capture_output=True, text=True).stdout.splitlines():
        f = line.split()
        if len(f) >= 8 and f[3] in ("FUNC", "IFUNC") and f[6] != "UND":
            name = f[7].split("@")[0]
            if not name.startswith(prefix.decode()):
                continue
            v = int(f[1], 16)
            for lo, hi, off in seg:
                if lo <= v < hi:
                    re_off.setdefault(name, v - lo + off)
                    break
    rm = [(n, ours.get(n), re_off.get(n)) for n in sorted(set(ours) | set(re_off)) if ours.get(n) != re_off.get(n)]
    print(f"readelf vs memrec: {len(re_off)} readelf names, {len(ours)} memrec names, mismatches {len(rm)}")
    for n, a, b in rm[:40]:
        print(f"  READELF-MISMATCH {n}: memrec {a} readelf {b}")
else:
    print("readelf: not installed on this host")
print("ELFSYMS", "OK" if not mism and not missing else "MISMATCH")
