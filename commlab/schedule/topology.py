"""A machine as the synthesizer and the simulator see it: hosts with their ranks (unequal
allowed, ranks numbered host by host), each host on one link of its own to a switch
(a star: a message between hosts crosses the sender's uplink and the receiver's
downlink, each with its own rate and latency, both directions at once), and one
point-to-point level inside every host.

    topo = Topology.parse("2,2,1", inter="1gbit,1gbit,200mbit:50us")
    simulate(schedule, topo, 16 << 20)     # seconds, from the schedule's own steps
    lower_bound("all_reduce", topo, 16 << 20)

The simulation follows the point-to-point executor (schedule/execute.py): a rank runs
its steps one after another in the checker's order; a send leaves when its step runs, a
receive waits for its message; messages crossing a link share it."""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

from commlab.core.units import parse_duration_us, parse_rate_gbps

from .check import Summary
from .ir import Schedule


@dataclass(frozen=True)
class Link:
    rate: float  # bytes per second, each direction
    latency: float  # seconds, one way

    @classmethod
    def parse(cls, text: str, latency_us: float) -> "Link":
        """RATE[:LATENCY] as tc writes them: 1gbit, 200mbit:50us."""
        rate, _, lat = text.strip().partition(":")
        return cls(parse_rate_gbps(rate) * 1e9, (parse_duration_us(lat) if lat else latency_us) * 1e-6)

    def __str__(self) -> str:
        return f"{self.rate * 8 / 1e9:g} Gbit/s, {self.latency * 1e6:g} µs"


@dataclass(frozen=True)
class Topology:
    hosts: tuple[int, ...]  # ranks of each host
    links: tuple[Link, ...]  # each host's link to the switch
    intra: Link  # a message between ranks of one host
    memory: float = 5e9  # bytes per second a rank copies or folds a received chunk at
    step: float = 250e-6  # seconds of a rank's time per step: the executor's own work, ranks sharing cores

    @classmethod
    def parse(cls, hosts: str, inter: str = "1gbit:50us", intra: str = "10gbit:50us",
              step_us: float = 250.0) -> "Topology":
        """hosts: ranks per host ("2,2,1"); inter: one RATE[:LATENCY] for every host link
        or one per host ("1gbit,1gbit,200mbit:50us": a latency given once is every
        link's); intra: the level inside a host; step_us: what a step costs a rank
        beyond its bytes (the point-to-point executor's Python and gloo's call)."""
        try:
            counts = tuple(int(x) for x in hosts.split(","))
        except ValueError:
            raise ValueError(f"not a topology: {hosts!r} (ranks per host, e.g. 2,2,1)") from None
        if not counts or min(counts) < 1:
            raise ValueError(f"not a topology: {hosts!r} (every host has at least one rank)")
        parts = inter.split(",")
        shared = [p.partition(":")[2] for p in parts if ":" in p]
        lat = parse_duration_us(shared[-1]) if shared else 50.0
        if len(parts) not in (1, len(counts)):
            raise ValueError(f"--inter names {len(parts)} links for {len(counts)} hosts (give one, or one per host)")
        links = tuple(Link.parse(p, lat) for p in (parts * len(counts) if len(parts) == 1 else parts))
        return cls(counts, links, Link.parse(intra, 50.0), step=step_us * 1e-6)

    @property
    def size(self) -> int:
        return sum(self.hosts)

    def host_of(self, rank: int) -> int:
        for h, n in enumerate(self.hosts):
            if rank < n:
                return h
            rank -= n
        raise ValueError(f"rank {rank} is past the topology's {self.size} ranks")

    def ranks_of(self, h: int) -> list[int]:
        start = sum(self.hosts[:h])
        return list(range(start, start + self.hosts[h]))

    def describe(self) -> str:
        return "; ".join(f"host {h}: {n} rank{'s' * (n > 1)}, link {self.links[h]}" for h, n in enumerate(self.hosts)) \
            + f"; inside a host {self.intra}; {self.step * 1e6:g} µs a step"


def chunk_bytes(s: Schedule, nbytes: float) -> float:
    """One chunk's bytes when the caller's larger buffer is `nbytes`."""
    return nbytes / s.chunks


def simulate(s: Schedule, summary: Summary, topo: Topology, nbytes: float) -> float:
    """The schedule's time in seconds on `topo` for a call of `nbytes` (the caller's
    larger buffer: all-gather's output, reduce-scatter's input), by events: a rank runs
    its steps in the checker's order, each costing it `step` (a send leaves then, a
    receive waits for its message, then copies or folds it); messages between hosts
    share each link they cross max-min fairly (as TCP flows do), those of one pair of
    ranks one after another (one connection); one inside a host costs its level's
    latency and rate."""
    if topo.size != s.size:
        raise ValueError(f"a schedule for {s.size} ranks on a topology of {topo.size}")
    chunk = chunk_bytes(s, nbytes)
    host = [topo.host_of(r) for r in range(s.size)]
    blocks = [{b.id: b for b in r.blocks} for r in s.ranks]
    programs = [[] for _ in range(s.size)]  # per rank: ("step"|"recv"|"send"|"local", connection, bytes)
    for r, bid, k in dict(summary.order)[s.modes()[0]]:
        b = blocks[r][bid]
        st = b.steps[k]
        if st.type == "nop":
            continue
        size = st.cnt * chunk
        programs[r].append(("step", None, 0.0))  # the executor's own work for the step
        if st.kind.receives:
            programs[r].append(("recv", (b.recv, r, b.chan), size))
        elif st.type in ("cpy", "re"):
            programs[r].append(("local", None, size))
        if st.kind.sends:
            programs[r].append(("send", (r, b.send, b.chan), size))
    capacity = {("up", h): lk.rate for h, lk in enumerate(topo.links)} | \
        {("down", h): lk.rate for h, lk in enumerate(topo.links)}
    pc, busy = [0] * s.size, [0.0] * s.size
    queues: dict = defaultdict(deque)  # key -> messages in order: [arrival time or None]
    flows: list = []  # [remaining bytes, links, message, latency, (sender, receiver)]
    timed: list = []  # (time, flow): flows about to start
    waiting: dict = defaultdict(deque)  # (sender, receiver) -> its flows, the first one moving
    t = 0.0
    while True:
        for r in range(s.size):  # every rank as far as it can go now
            while pc[r] < len(programs[r]) and busy[r] <= t:
                what, key, size = programs[r][pc[r]]
                if what == "recv":
                    q = queues[key]
                    if not q or q[0][0] is None or q[0][0] > t:
                        break
                    q.popleft()
                    busy[r] = t + size / topo.memory
                elif what == "local":
                    busy[r] = t + size / topo.memory
                elif what == "step":
                    busy[r] = t + topo.step
                else:
                    msg = [None]
                    queues[key].append(msg)
                    to = key[1]
                    if host[r] == host[to]:
                        msg[0] = t + topo.intra.latency + size / topo.intra.rate
                    else:
                        links = (("up", host[r]), ("down", host[to]))
                        lat = topo.links[host[r]].latency + topo.links[host[to]].latency
                        pair = (r, to)  # one connection per pair: its messages go one after another
                        waiting[pair].append([size, links, msg, lat, pair])
                        if len(waiting[pair]) == 1:
                            timed.append((t + topo.intra.latency, waiting[pair][0]))
                pc[r] += 1
        if all(pc[r] >= len(programs[r]) for r in range(s.size)) and not flows and not timed:
            return max([t] + busy)
        for at, flow in [x for x in timed if x[0] <= t]:
            flows.append(flow)
        timed = [x for x in timed if x[0] > t]
        rates = _fair_rates(flows, capacity)
        events = [b for b in busy if b > t] + [at for at, _ in timed] + \
            [m[0] for q in queues.values() for m in q if m[0] is not None and m[0] > t] + \
            [t + f[0] / rt for f, rt in zip(flows, rates) if rt > 0]
        if not events:
            raise ValueError("the schedule's simulation is stuck (a receive with no send)")
        nxt = min(events)
        left = []
        for f, rt in zip(flows, rates):
            f[0] -= rt * (nxt - t)
            if f[0] <= 1e-6 * max(chunk, 1.0):
                f[2][0] = nxt + f[3]
                q = waiting[f[4]]
                q.popleft()
                if q:
                    left.append(q[0])
            else:
                left.append(f)
        flows, t = left, nxt


def _fair_rates(flows: list, capacity: dict) -> list[float]:
    """Max-min fair rates of flows over the links each crosses (progressive filling)."""
    rates = [0.0] * len(flows)
    active = set(range(len(flows)))
    left = dict(capacity)
    while active:
        users: dict = defaultdict(list)
        for i in active:
            for lk in flows[i][1]:
                users[lk].append(i)
        share, link = min((left[lk] / len(us), lk) for lk, us in users.items())
        for i in active:
            rates[i] += share
        for lk, us in users.items():
            left[lk] -= share * len(us)
        done = set(users[link])
        active -= done
        for lk in list(left):
            if left[lk] <= 1e-9 * capacity[lk]:
                active -= set(users.get(lk, []))
    return rates


def lower_bound(collective: str, topo: Topology, nbytes: float) -> tuple[float, str]:
    """(seconds, why): no schedule on `topo` is faster. Bandwidth: the bytes some host's
    link must carry in one direction over its rate; latency: one link crossing each way
    for what must enter and what must leave a host."""
    p, H = topo.size, len(topo.hosts)
    if H == 1:
        return 0.0, "one host: no link to bound"
    best, why = 0.0, ""
    for h, n in enumerate(topo.hosts):
        link = topo.links[h]
        if collective == "all_reduce":
            # Every element's other contributions enter, or this host's leaves and the result enters.
            inbound = outbound = nbytes
        elif collective in ("all_gather", "reduce_scatter"):
            block = nbytes / p
            foreign, own = (p - n) * block, n * block
            inbound, outbound = (foreign, own) if collective == "all_gather" else (own, foreign)
        elif collective == "all_to_all":
            inbound = outbound = n * (p - n) * nbytes / p
        elif collective == "broadcast":
            inbound, outbound = nbytes, 0.0
        else:
            raise ValueError(f"no lower bound for {collective}")
        t = max(inbound, outbound) / link.rate + link.latency
        if t > best:
            best, why = t, f"host {h}'s link carries at least {max(inbound, outbound):.0f} B one way at {link}"
    return best, why
