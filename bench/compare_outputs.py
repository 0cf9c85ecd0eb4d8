"""Hash every output of a tree's memrec on the given traces, to compare two trees byte for byte.

    PYTHONPATH=/tmp/base .venv/bin/python bench/compare_outputs.py /tmp/base.json TRACE...
    PYTHONPATH=.         .venv/bin/python bench/compare_outputs.py /tmp/this.json TRACE...
    python3 -c 'import json,sys; a,b=(json.load(open(p)) for p in sys.argv[1:]); print(sorted(k for k in a.keys()|b.keys() if a.get(k)!=b.get(k)))' /tmp/base.json /tmp/this.json

Run from outside the repository (``cd /tmp``) so that ``PYTHONPATH`` picks the tree. Each output's
SHA-256 (stdout, stderr and exit status of a command; each file an export writes), in one process:
``report`` (text, ``--json``, ``-a``), ``diff A A`` (text, ``--json``), ``dump``, every export
(Perfetto, memory-viz, Parquet, CSV, the dataset), ``plot`` (the SVG, matplotlib's ``svg.hashsalt``
and ``SOURCE_DATE_EPOCH`` fixed) and ``memrec.load``'s tables; and ``diff`` of pairs of the
repository's example traces named among TRACE. Used for branch ``markers4`` (docs/performance.md).
"""
import contextlib, hashlib, io, json, os, shutil, sys, tempfile, warnings
os.environ["SOURCE_DATE_EPOCH"] = "0"
os.environ["COLUMNS"] = "100"
import matplotlib
matplotlib.use("Agg")
matplotlib.rcParams["svg.hashsalt"] = "memrec"
from memrec.commands import main
import memrec
import numpy as np

out_path, traces = sys.argv[1], sys.argv[2:]
res = {}
def h(b): return hashlib.sha256(b).hexdigest()
def run(key, argv):
    buf = io.StringIO()
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
            rc = main(argv)
    except SystemExit as e:
        rc = e.code
    res[key] = f"rc={rc} " + h(buf.getvalue().encode()) + " err=" + h(err.getvalue().encode())
def files(key, folder):
    for root, _, names in sorted(os.walk(folder)):
        for n in sorted(names):
            p = os.path.join(root, n)
            res[f"{key}:{os.path.relpath(p, folder)}"] = h(open(p, "rb").read())
for t in traces:
    name = os.path.basename(t)
    tmp = os.path.join(tempfile.gettempdir(), "compare-outputs-work")  # one path: commands print it
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    run(f"{name} report", ["report", t])
    run(f"{name} report --json", ["report", t, "--json"])
    run(f"{name} report -a", ["report", t, "-a"])
    run(f"{name} diff", ["diff", t, t])
    run(f"{name} diff --json", ["diff", t, t, "--json"])
    run(f"{name} dump", ["dump", t])
    for to in ("perfetto", "memory-viz", "parquet", "csv"):
        o = os.path.join(tmp, to)
        dest = o if to in ("parquet", "csv") else os.path.join(o, "out." + ("pftrace" if to == "perfetto" else "pickle"))
        os.makedirs(o, exist_ok=True)
        run(f"{name} export {to}", ["export", t, "--to", to, "-o", dest, "-f"])
        files(f"{name} export {to}", o)
    o = os.path.join(tmp, "dataset")
    run(f"{name} export dataset", ["export", t, "--to", "dataset", "-o", o])
    files(f"{name} export dataset", o)
    run(f"{name} plot", ["plot", t, "-o", os.path.join(tmp, "p.svg"), "-f"])
    if os.path.exists(os.path.join(tmp, "p.svg")):
        res[f"{name} plot svg"] = h(open(os.path.join(tmp, "p.svg"), "rb").read())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rec = memrec.load(t, pandas=False)
            for tab in ("events", "processes", "by_phase", "samples", "markers", "process_samples"):
                a = getattr(rec, tab, None)
                if a is not None:
                    a = np.asarray(a)
                    res[f"{name} load {tab}"] = h(repr(a.dtype).encode() + b"".join(
                        (a[f].tobytes() if a[f].dtype.kind != "O" else repr(a[f].tolist()).encode()) for f in (a.dtype.names or ())))
    except Exception as e:
        res[f"{name} load"] = "error " + type(e).__name__ + str(e)
    shutil.rmtree(tmp)
ex = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples") + "/"
for a, b in (("sglang-standin-base", "sglang-standin-ipc"), ("sglang-standin-base", "sglang-standin-stock"),
             ("seed-x2-base", "seed-x2-ipc"), ("torch-expandable", "torch-ipc"), ("sglang-standin-ipc", "torch-ipc")):
    if any(os.path.basename(t).startswith(a) for t in traces):
        run(f"diff {a} {b}", ["diff", ex + a + ".mrec", ex + b + ".mrec"])
        run(f"diff {a} {b} --json", ["diff", ex + a + ".mrec", ex + b + ".mrec", "--json"])
json.dump(res, open(out_path, "w"), indent=1, sort_keys=True)
print(len(res), "outputs")
