"""The main view follows the model whenever it learns a GPU, from any message and in any order.

A trace recorded without NVML (the stub driver, ``memrec demo``, any host without the NVIDIA
library) lists no GPU in its header: the GPUs are known only once events naming them are read,
which can come before or after the source says the file is loaded, or in a live stream long after
the header. Whatever the order, the GPU tabs appear, GPU0 is shown and its timeline is drawn.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import synth
from conftest import settle
from test_tui_live import ScriptedDaemon
from test_tui_live import sockdir  # noqa: F401 (a fixture)
from test_tui_live import wait_for

from memrec.trace.format import finalize_header
from memrec.tui import messages
from memrec.tui.app import MemrecApp
from memrec.tui.model import TraceModel
from memrec.tui.sources import FileSource
from memrec.tui.sources import LiveSource
from memrec.tui.widgets.panels import GpuHeader

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "seed-x2-base.mrec"


class ScriptedSource:
    """A file source whose worker runs ``steps`` in order: "learn" (the model reads the events,
    which name GPUs 0 and 1), "loaded" and "indexed" (the messages a FileSource posts)."""

    live = False
    other_model = None
    title = "scripted.mrec"

    def __init__(self, steps: list[str]) -> None:
        self.model = TraceModel()
        self.model.set_header({"gpus": []})
        self.steps = steps
        self.done = threading.Event()
        self.busy = lambda: False

    def run(self, post) -> None:
        for step in self.steps:
            if step == "learn":
                self.model.add_events(synth.without_nvml(synth.sglang_like()).events)
                while self.model.index_step():
                    pass
            elif step == "loaded":
                post(messages.Loaded(0.0))
            else:
                post(messages.Indexed(0.0))
            time.sleep(0.2)  # each step handled before the next, as on a slow or busy host
        self.done.set()

    def begin(self) -> None:
        """Scripted: nothing happens before the app is ready (:meth:`start`)."""

    def start(self, post) -> None:
        threading.Thread(target=self.run, args=(post,), daemon=True).start()

    def new_model(self) -> TraceModel:
        return TraceModel()

    def stop(self) -> None:
        pass


def assert_main_view(app: MemrecApp, gpu: int | None) -> None:
    """The tabs are built and one GPU's view is shown, its tab selected (``gpu``; None: the one the
    view chose, which depends on whether it knew the trace's failed call (on GPU1) when it opened)."""
    tabs = [t.id for t in app.query("Tab")]
    assert tabs == ["tab-gpu0", "tab-gpu1", "tab-all"], tabs
    gpu = app.main.gpu if gpu is None else gpu
    assert app.main.gpu == gpu and gpu in (0, 1)
    assert app.query_one("#gpu-tabs").active == f"tab-gpu{gpu}"
    assert app.query_one("#switcher").current == "gpu-view"
    assert str(app.query_one("#gpu-header", GpuHeader).render()).startswith(f"GPU{gpu}")


async def until(pilot, cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        await pilot.pause(0.05)
    await pilot.pause(0.3)  # a few ticks: whatever the app does after a change is done


@pytest.mark.parametrize(
    "steps",
    [
        pytest.param(["loaded", "learn", "indexed"], id="loaded-before-the-gpus"),
        pytest.param(["learn", "loaded", "indexed"], id="loaded-after-the-gpus"),
        pytest.param(["loaded", "indexed", "learn"], id="gpus-after-every-message"),
        pytest.param(["indexed", "learn", "loaded"], id="indexed-first"),
    ],
)
async def test_gpus_learned_in_any_order_build_the_tabs(steps):
    # GIVEN a source that learns its GPUs at some point among its messages
    source = ScriptedSource(steps)
    app = MemrecApp(source)
    async with app.run_test(size=(120, 36)) as pilot:
        # WHEN it has run all its steps
        await until(pilot, source.done.is_set)
        await until(pilot, lambda: len(app.query("Tab")) == 3)
        # THEN the GPU tabs exist and a GPU's view is shown
        assert_main_view(app, None)


@pytest.mark.parametrize("which", ["no-gpu-list", "gpu-list"])
async def test_a_file_opens_on_the_gpu_of_its_failed_call(tmp_path, which):
    # GIVEN a trace file recorded without NVML (no GPU list), or one with a GPU list
    if which == "no-gpu-list":
        path = tmp_path / "no-nvml.mrec"
        synth.write_trace(path, synth.without_nvml(synth.sglang_like()))
    else:
        path = EXAMPLE
    app = MemrecApp(FileSource(path))
    async with app.run_test(size=(120, 36)) as pilot:
        # WHEN it is loaded and replayed
        await settle(pilot)
        # THEN the tabs are built and the GPU of the failed call is shown (the example has none: the GPU of its peak, GPU0)
        # (saying what a trace without NVML lacks)
        assert app.main.loaded and app.main.indexed
        assert_main_view(app, 1 if which == "no-gpu-list" else 0)
        header = str(app.query_one("#gpu-header", GpuHeader).render())
        assert ("(no NVML: name and size not recorded)" in header) == (which == "no-gpu-list")


async def test_live_stream_names_its_gpus_after_the_header(sockdir, trace):  # noqa: F811
    # GIVEN a daemon without NVML: its header lists no GPU and no event has come yet
    header = finalize_header({**trace.header, "gpus": []})
    daemon = ScriptedDaemon(sockdir / "d.sock", [header])
    app = MemrecApp(LiveSource(str(sockdir / "d.sock")), refresh_interval=0.05)
    try:
        async with app.run_test(size=(120, 36)) as pilot:
            await wait_for(pilot, lambda: daemon.subscribed.is_set() and app.link.connected)
            assert [t.id for t in app.query("Tab")] == []
            # WHEN the first events arrive, naming GPUs 0 and 1
            daemon.send({"type": "events", "events": trace.events[:40]})
            await wait_for(pilot, lambda: len(app.query("Tab")) == 3)
            # THEN the view follows: tabs built and GPU0 shown
            assert_main_view(app, 0)
    finally:
        daemon.close()
