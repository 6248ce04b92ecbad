"""What a publish job says while a step runs: a line at least every HEARTBEAT_S seconds
(`ENVBUILD_HEARTBEAT_S`) with the step and its time, and during a build a line per finished
BuildKit step and the one now running named by the heartbeat. A CI job that prints nothing for 15
minutes looks hung and gets cancelled; a build of an hour prints little of its own."""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Optional

from envbuild.builds.build import LayerCache


HEARTBEAT_S = float(os.environ.get("ENVBUILD_HEARTBEAT_S") or 60)  # a line at least this often while a step runs


class Heartbeat:
    """While a long step runs (a build of an hour, BuildKit waiting on a lock, a push of 6 GB), a
    line every HEARTBEAT_S seconds with the step, the time it has taken and, for a build, the
    BuildKit step now running (`activity['build']`): a job that prints nothing for 15 minutes
    looks hung and gets cancelled."""

    def __init__(self, say: Callable[[str], None], label: str, activity: Optional[dict] = None):
        self.say, self.label, self.activity = say, label, activity if activity is not None else {}
        self.stop = threading.Event()
        self.every: Optional[float] = None  # HEARTBEAT_S, read when the step starts
        self.start = time.monotonic()
        self.thread = threading.Thread(target=self._beat, daemon=True, name=f"heartbeat {label}")

    def _beat(self) -> None:
        while not self.stop.wait(self.every):
            elapsed = int(time.monotonic() - self.start)
            now = self.activity.get("build")
            self.say(f"{self.label}: still running, {elapsed // 60} min {elapsed % 60:02d} s"
                     + (f" (now: {now})" if now else ""))

    def __enter__(self) -> "Heartbeat":
        self.every = HEARTBEAT_S
        self.say(f"{self.label}: started")
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def build_hooks(variant: dict, activity: dict, cache: Optional[LayerCache], say: Callable[[str], None]) -> dict:
    """build_image's progress and cache for one variant: a line per finished BuildKit step, the
    step now running kept in `activity` for the heartbeat, the variant's layer cache."""
    activity.clear()
    name = variant["variant"]

    def on_step(event: str, step: str) -> None:
        if event == "start":
            activity["build"] = step[:120]
        elif event == "done":
            say(f"{name}: done {step}"[:160])

    return {"on_step": on_step, "cache": cache, "say": lambda text: say(f"{name}: {text}")}
