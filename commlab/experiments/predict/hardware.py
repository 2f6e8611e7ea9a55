"""A hardware profile (`profiles/*.json`, or this host's measured `this_host`) and what
a step's pieces cost on it: an operation (the larger of FLOPs at the datasheet rate and
bytes at the memory bandwidth: a roofline, so compute is a lower bound), a collective
(the fitted or datasheet α-β model, stretched as in training), first touches and copies."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from commlab import algorithms
from commlab.experiments.predict.graph import Step
from commlab.measure import costmodel

PROFILES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")


@dataclass
class Profile:
    name: str
    description: str
    device: str  # cuda | cpu
    memory_bytes: float
    memory_bandwidth_gbps: float
    peak_tflops: dict
    link: dict
    host_link_gbps: float = 0.0
    sources: list = field(default_factory=list)
    # this-host (CPU): what was measured instead of a datasheet
    compute_ms: float | None = None  # one compute-only step (ddp:noop) of the model at the batch compared
    fits: dict = field(default_factory=dict)  # collective -> algorithm -> {alpha_us, beta_us_per_byte, gamma_us_per_byte}
    measured: dict = field(default_factory=dict)  # collective -> algorithm -> [[bytes, µs], ...]: the bench's own rows
    overlap: bool = True  # False where ranks outnumber cores: communication shares the cores backward needs
    arrival_skew_ms: float = 0.0  # the wait for the last rank DDP shows (from ddp:noop's ends of backward)
    optimizer_ms: float | None = None  # of compute_ms, the optimizer step (ddp:noop): shared out by bytes, not FLOPs
    copy_us_per_byte: float | None = None  # this host: a byte read or written by a copy (a third of the bench's γ)
    # this host: a fresh buffer's page faults per byte, with ranks sharing cores; one rate, or [[bytes, rate], ...]
    # measured per size (a size pays the rate at the largest size not above it: glibc recycles small buffers)
    first_touch_us_per_byte: float | list = 0.0
    # this host: the wait for the last rank summed over a step's synchronisations, from ddp:noop (key: the
    # synchronisations; FSDP's units by its marks, "fbe" resharded: each unit's forward, backward and backward's
    # end, "fe" not resharded; "step_start": backward's end alone, drifting from the step's start, as ZeRO-1's
    # broadcasts line the ranks up after the optimizer; arrival_skew_ms: DDP's, from one end of backward to the next)
    unit_waits_ms: dict = field(default_factory=dict)
    # this host, FSDP: each collective called after compute, as training calls it (measure.syncprobe:
    # collective -> algorithm -> after_us, exit_spread_us at bytes): its ratio to the bench, its exit spread
    in_training: dict = field(default_factory=dict)
    # this host: the standard error of each wait above over ddp:noop's steps ("step": arrival_skew_ms's;
    # the others: unit_waits_ms'): how much the host's drift moves from step to step, the exposed sync's ±
    wait_se_ms: dict = field(default_factory=dict)


def profile_names() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(PROFILES) if f.endswith(".json"))


def load_profile(name: str) -> Profile:
    path = name if name.endswith(".json") else os.path.join(PROFILES, name + ".json")
    if not os.path.exists(path):
        raise ValueError(f"no hardware profile {name!r} (profiles: {', '.join(profile_names())}, this-host, or a file)")
    with open(path) as f:
        return Profile(**json.load(f))


def this_host(benches: list[dict], compute_ms: float, ranks: int, cores: int, arrival_skew_ms: float = 0.0,
              optimizer_ms: float | None = None, first_touch_us_per_byte: float | list = 0.0,
              unit_waits_ms: dict | None = None, in_training: dict | None = None,
              wait_se_ms: dict | None = None) -> Profile:
    """This machine, measured: each algorithm's times from bench runs (one per collective)
    at the world size compared, interpolated between the sizes timed, and their α, β, γ
    fit beyond them; the compute-only step and how far apart the ranks reach their first
    bucket (both from ddp:noop)."""
    fits: dict = {}
    measured: dict = {}
    gammas = [b["env"]["gamma_us_per_byte"] for b in benches if b["env"].get("gamma_us_per_byte")]
    for bench in benches:
        p, collective = int(bench["env"]["world_size"]), bench.get("collective", "all_reduce")
        got = costmodel.fit([(r["algorithm"], p, r["bytes"], r["time_us"]) for r in bench["results"]],
                            bench["env"].get("gamma_us_per_byte"), collective)
        fits[collective] = {a: {"alpha_us": f.alpha_us, "beta_us_per_byte": f.beta_us_per_byte,
                                "gamma_us_per_byte": f.gamma_us_per_byte} for a, f in got.items()}
        for r in bench["results"]:
            measured.setdefault(collective, {}).setdefault(r["algorithm"], []).append([r["bytes"], r["time_us"]])
    return Profile(name="this-host", description=f"this machine: {cores} cores, {ranks} ranks; fitted from bench runs",
                   device="cpu", memory_bytes=0.0, memory_bandwidth_gbps=0.0, peak_tflops={}, link={},
                   compute_ms=compute_ms, overlap=ranks < cores, arrival_skew_ms=arrival_skew_ms or 0.0, fits=fits,
                   measured={c: {a: sorted(rows) for a, rows in by.items()} for c, by in measured.items()},
                   optimizer_ms=optimizer_ms,
                   unit_waits_ms={k: v for k, v in (unit_waits_ms or {}).items() if v is not None},
                   in_training=in_training or {},
                   wait_se_ms={k: v for k, v in (wait_se_ms or {}).items() if v is not None},
                   # γ: one element-wise SUM per byte of input, three bytes of traffic (two reads, one write)
                   copy_us_per_byte=gammas[0] / 3 if gammas else None,
                   # measured on one idle process: stretched as each rank gets cores/ranks of a core
                   first_touch_us_per_byte=_stretched(first_touch_us_per_byte, max(1.0, ranks / cores)),
                   sources=[{"what": ", ".join(fits), "source": "commlab.allreduce_bench at this world size, fitted"},
                            {"what": "compute_ms", "source": "commlab.compare's ddp:noop in the same run"}])


def op_times_us(step: Step, prof: Profile, amp: str | None, micro_steps: int = 1) -> list[float]:
    """Per operation of one micro-step (and the step's optimizer): the roofline on a GPU
    profile; on this host, the measured compute-only step (all its micro-steps) shared
    out by FLOPs (its matrix products dominate), its measured optimizer step
    (element-wise: no FLOPs counted) by bytes over the optimizer's ops."""
    if prof.compute_ms is not None:
        opt_us = (prof.optimizer_ms or 0.0) * 1e3
        flops = sum(o.flops for o in step.ops if o.phase != "opt") or 1.0
        moved = sum(o.bytes for o in step.ops if o.phase == "opt") or 1.0
        rest = max(prof.compute_ms * 1e3 - opt_us, 0.0) / max(micro_steps, 1)
        return [opt_us * o.bytes / moved if o.phase == "opt" else rest * o.flops / flops for o in step.ops]
    bw = prof.memory_bandwidth_gbps * 1e3  # bytes per µs
    out = []
    for o in step.ops:
        if o.kind and amp:
            rate = prof.peak_tflops[amp]
        else:  # torch's defaults: fp32 convolutions may use TF32 (cudnn.allow_tf32), matrix products do not
            rate = prof.peak_tflops["tf32" if o.kind == "conv" else "fp32"]
        moved = o.bytes * (0.5 if amp and o.phase != "opt" else 1.0)  # 16-bit activations under autocast
        out.append(max(o.flops / (rate * 1e6), moved / bw))
    return out


def collective_us(prof: Profile, collective: str, algorithm: str, p: int, nbytes: float) -> float:
    """One call of a family's algorithm on nbytes (its cost formula's size: all-reduce's
    buffer, all-gather's output, reduce-scatter's input, broadcast's buffer): on this host
    the bench's times (its fit past the sizes it timed); the link's rates on a hardware profile."""
    c = algorithms.registry(collective).get(algorithm).cost(p, nbytes)
    if prof.compute_ms is not None:  # measured on this host
        rows = prof.measured.get(collective, {}).get(algorithm) or []
        if len(rows) > 1 and rows[0][0] <= nbytes <= rows[-1][0]:
            # Between two sizes the bench timed: its own times, interpolated (exact for an
            # affine cost). The fit is for sizes it did not reach: gloo's all-gather grows
            # faster than linearly past 16 MiB (docs/measurements.md#figures-behind-the-codes-choices).
            k = next(i for i in range(1, len(rows)) if nbytes <= rows[i][0])
            (n0, t0), (n1, t1) = rows[k - 1], rows[k]
            return t1 if n1 == n0 else t0 + (t1 - t0) * (nbytes - n0) / (n1 - n0)
        f = prof.fits.get(collective, {}).get(algorithm)
        if f is None:
            raise ValueError(f"this-host has no {collective} fit for {algorithm!r} "
                             f"(bench it: --collective {collective} --algorithms ...,{algorithm})")
        return c.time(f["alpha_us"], f["beta_us_per_byte"], f["gamma_us_per_byte"])
    link = prof.link
    gamma = 3 / (prof.memory_bandwidth_gbps * 1e3)  # a reduced byte: two reads and a write of device memory
    return link["call_latency_us"] + c.time(link["step_latency_us"], 1 / (link["gbps"] * 1e3), gamma)


def in_training(prof, probe: str, algorithm: str, p: int, collective: str | None = None,
                reused: bool = False) -> tuple[float, float, bool]:
    """(how much longer a call takes after compute than the bench's back-to-back one, its
    exit spread per µs of call, whether a probe gave them) from this host's probe
    (measure.syncprobe) at its size; (1, 0, False) without one (a hardware profile: one
    rank per device, none descheduled) or where it timed nothing. FSDP's calls and DDP's
    buckets both; ZeRO-1's broadcasts (probe syncprobe.ZERO1, collective "broadcast"): a
    call per size it lists, priced one after another. reused: FSDP's calls into buffers
    the allocator recycled, where probed (else the fresh ones')."""
    got = prof.in_training.get(probe, {}).get(algorithm)
    if reused and got and got.get("reused"):
        got = got["reused"]
    if not got or got["after_us"] <= 0:
        return 1.0, 0.0, False
    priced = sum(collective_us(prof, collective or probe, algorithm, p, n) for n in got.get("sizes") or [got["bytes"]])
    return got["after_us"] / priced, got["exit_spread_us"] / got["after_us"], True


def _stretched(rate: float | list, by: float) -> float | list:
    return [[n, r * by] for n, r in rate] if isinstance(rate, list) else rate * by


def wait_charged(prof: Profile, kinds: str = "step") -> tuple[float, float | None]:
    """(ms a rank waits at synchronisations of these kinds per step, its standard error):
    "step" once, at backward's end, drifting from the previous one (DDP); "step_start" once,
    at backward's end, drifting from the step's start (ZeRO-1, whose broadcasts synchronise
    after the optimizer); FSDP's units by ddp:noop's marks ("fbe" resharded, "fe" not); the
    once-a-step figure where the kind was not measured."""
    if kinds != "step" and kinds in prof.unit_waits_ms:
        return prof.unit_waits_ms[kinds], prof.wait_se_ms.get(kinds)
    return prof.arrival_skew_ms, prof.wait_se_ms.get("step")


def first_touch_us(prof: Profile, nbytes: float) -> float:
    """The page faults of a freshly allocated nbytes buffer's first write (this host; 0 on
    a hardware profile, whose caching allocator has none): at the rate measured at the
    largest size not above it."""
    rate = prof.first_touch_us_per_byte
    if isinstance(rate, list):
        below = [r for n, r in sorted(rate) if n <= nbytes]
        rate = below[-1] if below else 0.0
    return rate * nbytes


def copy_us(prof: Profile, traffic_bytes: float) -> float:
    """Bytes read and written by memory copies: at the profile's memory bandwidth, or
    this host's measured rate."""
    if prof.compute_ms is not None:
        return traffic_bytes * (prof.copy_us_per_byte or 0.0)
    return traffic_bytes / (prof.memory_bandwidth_gbps * 1e3)


def allreduce_us(prof: Profile, algorithm: str, p: int, nbytes: float) -> float:
    return collective_us(prof, "all_reduce", algorithm, p, nbytes)
