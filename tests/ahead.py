"""End-to-end runs started ahead of their tests, two at a time. Each is a fresh interpreter
(or several) that spends seconds importing torch on one core: run one after another they
left a core idle for a third of their time. Only runs whose test asserts nothing about
time belong here, in a module whose tests assert nothing about time either (they run beside
them).

    launches = ahead.launches({"test_name": lambda tmp, **params: ahead.Launch([...])})

    def test_name(launches, request):
        proc, tmp = launches.take(request)   # the CompletedProcess, and the run's folder
"""
from __future__ import annotations

import os
import pathlib
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
AT_ONCE = 2  # the cores of the machines the suite runs on; more only queues


@dataclass
class Launch:
    cmd: list[str]
    env: dict | None = None
    cwd: pathlib.Path | str = ROOT
    timeout: float = 300.0
    extra: dict = field(default_factory=dict)  # what the test needs to know of how it was launched


def _run(launch: Launch):
    try:
        return subprocess.run(launch.cmd, cwd=launch.cwd, env=launch.env or dict(os.environ), capture_output=True,
                              text=True, timeout=launch.timeout)
    except subprocess.TimeoutExpired as e:
        return e


class Launches:
    def __init__(self, futures: dict):
        self._futures = futures

    def take(self, request) -> tuple[subprocess.CompletedProcess, pathlib.Path, Launch]:
        """This test's run: (its process, its folder, its launch); a run past its timeout fails the test."""
        future, tmp, launch = self._futures[request.node.name]
        proc = future.result()
        if isinstance(proc, subprocess.TimeoutExpired):
            pytest.fail(f"{launch.cmd} ran past {proc.timeout:.0f} s:\n{(proc.stdout or b'')[-3000:]!r}")
        return proc, tmp, launch


def launches(factories: dict[str, Callable[..., Launch | None]]):
    """A module fixture: at the first test that asks, every selected test of the module named
    in `factories` has its run started, in the order of collection, AT_ONCE at a time. A
    factory gets a folder of its own and the test's parameters, and returns None for a test
    that runs nothing (it skips, or checks a file)."""

    @pytest.fixture(scope="module")
    def fixture(request, tmp_path_factory):
        items = [i for i in request.session.items if i.module is request.module and i.originalname in factories]
        with ThreadPoolExecutor(max_workers=AT_ONCE) as pool:
            futures = {}
            for item in items:
                tmp = tmp_path_factory.mktemp(item.originalname[:40])
                launch = factories[item.originalname](tmp, **(item.callspec.params if hasattr(item, "callspec") else {}))
                if launch is not None:
                    futures[item.name] = (pool.submit(_run, launch), tmp, launch)
            yield Launches(futures)

    return fixture
