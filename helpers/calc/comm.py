"""Communication arithmetic: bus bandwidth of an all-reduce, and the bytes one rank sends per collective.

Pure calculations: no process group, no subprocess. The ranks measure; these turn the measurements into numbers
that compare with the hardware's link speed (:func:`bus_bandwidth`) or with the ZeRO paper's communication model
(:func:`bytes_sent_per_rank`: 2P per step for DDP's all-reduce, 3P for ZeRO-3).

Example::

    bus_bandwidth(1e9, 1.0, 8)                  # (1.0, 1.75): GB/s
    bytes_sent_per_rank("all_reduce", 4e6, 2)   # 4000000.0
"""
from __future__ import annotations


def bus_bandwidth(size_bytes: float, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes/s) of one all-reduce of ``size_bytes`` taking ``seconds``.

    Definitions from nccl-tests, doc/PERFORMANCE.md (https://github.com/NVIDIA/nccl-tests):
    ``algbw = size / time``; for all-reduce ``busbw = algbw * 2*(n-1)/n``, because a ring all-reduce moves
    each byte 2*(n-1)/n times over the slowest link -- busbw is comparable with the hardware's link speed.

    >>> bus_bandwidth(1e9, 1.0, 8)
    (1.0, 1.75)
    """
    if seconds <= 0 or world_size < 1:
        raise ValueError("seconds must be > 0 and world_size >= 1")
    algbw = size_bytes / seconds / 1e9
    return algbw, algbw * 2 * (world_size - 1) / world_size

def bytes_sent_per_rank(op: str, message_bytes: float, world_size: int) -> float:
    """Bytes one rank sends for one collective under the usual ring algorithms (the ZeRO paper's Sec. 7 model).

    ``message_bytes`` is what the counters record: the tensor handed to the collective. For ``all_reduce`` that is
    the whole buffer S (a ring sends 2 S (N-1)/N: a reduce-scatter then an all-gather); for ``reduce_scatter_tensor``
    the whole input S (S (N-1)/N); for ``all_gather_into_tensor`` this rank's shard s (s (N-1): every other rank
    needs it). Other operations (broadcast, barrier) are counted as their message size.

    Example::

        bytes_sent_per_rank("all_reduce", 4e6, 2)   # 4000000.0
    """
    n = world_size
    if op == "all_reduce":
        return 2 * message_bytes * (n - 1) / n
    if op in ("reduce_scatter_tensor", "reduce_scatter"):
        return message_bytes * (n - 1) / n
    if op in ("all_gather_into_tensor", "all_gather"):
        return message_bytes * (n - 1)
    return float(message_bytes)


def fit_alpha_beta(sizes: list[float], seconds: list[float]) -> dict:
    """The alpha-beta model of one collective on one machine, ``time = alpha + beta x bytes``, fitted by least
    squares to measured (message size, seconds) pairs; returns ``alpha`` (s: the fixed cost, latency and
    software), ``beta`` (s per byte), ``bandwidth`` (1 / beta, GB/s, of the collective's message, what nccl-tests
    calls algbw at large sizes) and ``residuals`` (measured / fitted - 1 per point).

    The points are weighted by 1 / time, so that a 1 KiB message's 50 us counts as much as a 16 MiB message's
    30 ms (a plain fit would let the large messages decide alpha alone).

    >>> r = fit_alpha_beta([1e3, 1e6, 1e7], [1e-4 + 1e3 / 1e9, 1e-4 + 1e6 / 1e9, 1e-4 + 1e7 / 1e9])
    >>> round(r["alpha"] * 1e6, 3), round(r["bandwidth"], 3)
    (100.0, 1.0)
    """
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError(f"need two or more (size, seconds) pairs, got {len(sizes)} and {len(seconds)}")
    if len(set(sizes)) < 2 or min(seconds) <= 0:
        raise ValueError("need at least two different sizes and positive times")
    w = [1.0 / t for t in seconds]  # relative errors: each point weighs as much as the others
    sw = sum(x * x for x in w)
    sx = sum(x * x * n for x, n in zip(w, sizes))
    sxx = sum(x * x * n * n for x, n in zip(w, sizes))
    sy = sum(x * x * t for x, t in zip(w, seconds))
    sxy = sum(x * x * n * t for x, n, t in zip(w, sizes, seconds))
    det = sw * sxx - sx * sx
    beta = (sw * sxy - sx * sy) / det
    alpha = (sy - beta * sx) / sw
    fitted = [alpha + beta * n for n in sizes]
    return {"alpha": alpha, "beta": beta, "bandwidth": (1.0 / beta / 1e9) if beta > 0 else float("inf"),
            "residuals": [t / f - 1 for t, f in zip(seconds, fitted)]}


def never_cheaper(sizes: list[float], seconds: list[float]) -> list[float]:
    """Each size's cost capped by every larger size's: moving more bytes never takes less time, so a size timed
    slower than a larger one was slowed by something else (a busy core, a late wake-up: what a fastest call
    already leaves out) and costs what the cheapest larger size cost. One sweep here timed a 128 KiB all-reduce at
    0.97 ms and a 256 KiB one at 0.40 ms; priced by the line through those two, a 147 KiB message cost twice
    what the trace timed.

    >>> never_cheaper([1, 2, 4], [3.0, 1.0, 2.0])
    [1.0, 1.0, 2.0]
    """
    if len(sizes) != len(seconds):
        raise ValueError(f"{len(sizes)} sizes but {len(seconds)} times")
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    out, cheapest = list(seconds), float("inf")
    for i in reversed(order):
        cheapest = min(cheapest, seconds[i])
        out[i] = cheapest
    return out


def predict_seconds(fit: dict, message_bytes: float, count: int = 1) -> float:
    """``count`` collectives of ``message_bytes`` each by a :func:`fit_alpha_beta` model."""
    return count * (fit["alpha"] + fit["beta"] * message_bytes)


def local_seconds(sizes: list[float], seconds: list[float], message_bytes: float) -> float:
    """One collective of ``message_bytes`` priced from a sweep by the line through the two measured sizes around it:
    an alpha-beta model per size range (beyond the sweep, its nearest range's line, never below zero). On a CPU
    the cost per byte grows once a message outgrows a cache, so one line from 32 KiB to 32 MiB misprices one end
    or the other; each range's line passes through its own two measurements.

    >>> local_seconds([1e6, 2e6, 4e6], [1e-3, 2e-3, 6e-3], 3e6)  # half-way between 2e-3 and 6e-3
    0.004
    """
    if len(sizes) != len(seconds) or len(set(sizes)) < 2:
        raise ValueError(f"need two or more different sizes with a time each, got {len(sizes)} sizes and "
                         f"{len(seconds)} times")
    points = sorted(zip(sizes, seconds))
    k = next((i for i in range(1, len(points) - 1) if message_bytes <= points[i][0]), len(points) - 1)
    (x0, y0), (x1, y1) = points[k - 1], points[k]
    return max(0.0, y0 + (y1 - y0) * (message_bytes - x0) / (x1 - x0))


def predict_calls(fits: dict, calls: list[tuple[str, float]], local: bool = False,
                  idle: float | None = None) -> float:
    """Seconds for a list of ``(collective, message bytes)`` calls, each by its collective's
    :func:`fit_alpha_beta` model in ``fits``, or with ``local`` by :func:`local_seconds` on the ``sizes`` and
    ``seconds`` the fit was made from, or with ``idle`` (ms) by :func:`idle_seconds` on the ``by_idle`` times
    kept beside them. Those two price each size at no more than any larger size (:func:`never_cheaper`); the
    measurements themselves are left as they were timed. A KeyError names a collective with no model."""
    ops = {op for op, _ in calls}
    missing = sorted(ops - set(fits))
    if missing:
        raise KeyError(f"no alpha-beta model for {', '.join(missing)}: sweep it first (course/collective_sweep.py)")
    # each collective's costs capped once, not once per call
    if idle is not None:
        by_idle = {op: {g: never_cheaper(fits[op]["sizes"], t) for g, t in fits[op]["by_idle"].items()} for op in ops}
        return sum(idle_seconds(fits[op]["sizes"], by_idle[op], size, idle) for op, size in calls)
    if local:
        seconds = {op: never_cheaper(fits[op]["sizes"], fits[op]["seconds"]) for op in ops}
        return sum(local_seconds(fits[op]["sizes"], seconds[op], size) for op, size in calls)
    return sum(predict_seconds(fits[op], size) for op, size in calls)


def idle_seconds(sizes: list[float], seconds_by_idle: dict[float, list[float]], message_bytes: float,
                 idle: float) -> float:
    """One collective of ``message_bytes`` that follows ``idle`` milliseconds without communication, priced from a
    sweep timed at several idle times (``{idle ms: seconds at each of sizes}``, 0 for calls back to back): each
    idle time's :func:`local_seconds`, and between two idle times the line through them (beyond the longest, its
    price). On this CPU a 2 MiB all-gather that follows 30 ms of compute costs about 1.8 times one that follows
    another, and the penalty hardly grows with the size: what was idle wakes up first.

    >>> idle_seconds([1e6, 2e6], {0: [1e-3, 2e-3], 10: [2e-3, 3e-3]}, 1e6, 5)  # half-way between 1e-3 and 2e-3
    0.0015
    """
    if not seconds_by_idle or idle < 0:
        raise ValueError(f"need the sweep at one idle time or more and an idle time >= 0, got "
                         f"{sorted(seconds_by_idle)} and {idle}")
    points = sorted((g, local_seconds(sizes, s, message_bytes)) for g, s in seconds_by_idle.items())
    if idle <= points[0][0]:
        return points[0][1]
    for (g0, y0), (g1, y1) in zip(points, points[1:]):
        if idle <= g1:
            return y0 + (y1 - y0) * (idle - g0) / (g1 - g0)
    return points[-1][1]
