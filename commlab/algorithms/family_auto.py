"""What the `auto` of every family but all-reduce's shares: one decision per group, made
collectively on the plan's first call from the ranks' host ids, so every rank picks
alike; the algorithm picked is kept in the plan's context. A family's auto says only
how it chooses (`choose`): an algorithm of its registry, or itself for a choice it makes
per call from facts every rank agreed on (the call's size, all-to-all's counts)."""
from __future__ import annotations

import importlib

from commlab.transports import shm
from commlab.transports.setup import host_ids


class Layout:
    """The group's hosts as auto needs them: one host, and whether some host has
    several ranks whose shared memory is usable."""

    def __init__(self, hosts: list, shm_ok: bool):
        self.one_host = len(set(hosts)) == 1 and shm_ok
        self.shared = len(hosts) > len(set(hosts)) and shm_ok


class FamilyAuto:
    name = "auto"
    family = ""  # the collective whose registry it picks from
    formula = "that of the algorithm it picks (modelled as shm's)"
    wins_when = "you do not want to choose"
    order = 5

    def registry(self):
        return importlib.import_module(f"commlab.algorithms.{self.family}")

    def cost(self, p, nbytes):
        return self.registry().get("shm").cost(p, nbytes)

    def choose(self, t, ctx, layout: Layout):
        """The algorithm for a CPU tensor's group (a registry member, or self)."""
        raise NotImplementedError

    def prepare(self, t, ctx) -> None:
        self.pick(t, ctx)

    def pick(self, t, ctx):
        """Collective on a plan's first call: every rank gathers the same host ids."""
        if ctx.transport is None:
            if not t.is_cpu:
                ctx.transport = self.registry().get("builtin")
            else:
                hosts = host_ids(ctx.info, "auto", f"choosing a {self.family} algorithm")
                ctx.transport = self.choose(t, ctx, Layout(hosts, shm.unsupported(ctx.info) is None))
        return ctx.transport

    def checks_calls(self, ctx):
        return ctx.transport is not None and ctx.transport is not self and ctx.transport.checks_calls(ctx)
