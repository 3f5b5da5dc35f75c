"""What a sweep writes: the table (folded into the one there for a sweep of some kernels)
and its report, the tuned configs against the defaults."""

from __future__ import annotations

import datetime
import json
import pathlib

import torch

from .. import tuning


def changed_keys(config: dict, default: dict) -> str:
    """The report's "tuned keys (default's)": each key of ``config`` whose value differs
    from ``default``'s, with the default's value, or "unset" for a key it lacks (the
    staged experts' HALF_TILE, say)."""
    return ", ".join(f"{k} {v} ({default[k] if k in default else 'unset'})"
                     for k, v in config.items() if not k.startswith("_")
                     and (k not in default or default[k] != v))


def _fold(old: dict, new: dict, whole: set) -> dict:
    """{kernel: {shape: {bucket: ...}}} of ``old`` with ``new``'s entries laid over it
    bucket by bucket, so that a sweep of some buckets keeps the table's others; except
    the (kernel, shape) pairs in ``whole``, which replace theirs whole: a kernel with
    reduction keys has one reduction setting a shape, and the buckets of two sweeps may
    hold two."""
    out = {k: {s: dict(buckets) for s, buckets in shapes.items()} for k, shapes in old.items()}
    for kernel, shapes in new.items():
        for shape, buckets in shapes.items():
            kept = {} if (kernel, shape) in whole else out.get(kernel, {}).get(shape, {})
            out.setdefault(kernel, {})[shape] = {**kept, **buckets}
    return out


def write_table(done: dict, path: pathlib.Path, args=None) -> None:
    """The table of the sweep ``done`` at ``path``. A sweep of some kernels only
    (``--kernels``) folds into the table already there, or where there is none into the
    one the layer reads now on this GPU (``_fold``): the buckets it swept replace theirs,
    every other entry stays; a shape of a kernel with reduction keys is replaced whole."""
    import triton

    gpu = tuning.gpu_name()
    name = gpu or "interpreter (dry run)"
    kernels = {k: {s: {b: {n: v for n, v in c.items() if not n.startswith("_")}
                       for b, c in buckets.items()} for s, buckets in shapes.items()}
               for k, shapes in done.items()}
    timings = {k: {s: {b: {"tuned": c.get("_us"), "default": c.get("_default_us")}
                       for b, c in buckets.items()}
                   for s, buckets in shapes.items()} for k, shapes in done.items()}
    # The GPU's capability, SMs and memory: what a GPU without a table of its own is
    # matched on when it falls back to the nearest table (tuning.nearest_table).
    table = {"gpu": name, **tuning.device_properties(), "triton": triton.__version__, "torch": torch.__version__,
             "date": datetime.date.today().isoformat(),
             "dims": "Kimi-K3 (H 7168, L 3584, E 896, K 16, I 3072) rank-local shapes",
             "kernels": kernels, "timings_us": timings}
    if args is not None:
        table["sweep"] = (f"{'--quick ' if args.quick else ''}--tp {' '.join(map(str, args.tp))}"
                          f" --batches {' '.join(map(str, sorted(args.batches)))}"
                          f"{' --kernels ' + ' '.join(args.kernels) if args.kernels else ''}"
                          f" (final: {args.finalists} finalists, {args.rounds} rounds)"
                          f"{' (stopped at --time-limit: incomplete)' if args.stopped else ''}")
        old = _base_table(path, gpu) if args.kernels else None
        if old is not None:
            # An entry without the marker is taken as having reduction keys: replaced
            # whole, the choice that can never mix two entries' reduction orders.
            whole = {(k, s) for k, shapes in done.items() for s, buckets in shapes.items()
                     if any(c.get("_reduction", True) for c in buckets.values())}
            table["kernels"] = _fold(old.get("kernels", {}), kernels, whole)
            table["timings_us"] = _fold(old.get("timings_us", {}), timings, whole)
            table["sweep"] = f"{old.get('sweep', '?')}; then {table['sweep']}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {path}")


def _base_table(path: pathlib.Path, gpu: str | None) -> dict | None:
    """What a sweep of some kernels folds into: the table at ``path``, else GPU ``gpu``'s
    table that the layer reads now (``tuning.find_table``: a shipped one, say), else
    None."""
    found = path if path.exists() else (tuning.find_table(gpu) if gpu else None)
    return None if found is None else read_json(found)


def read_json(path) -> dict:
    """The JSON object in file ``path``; ValueError naming the file where it holds none
    (a table or a partial sweep edited by hand, or cut short)."""
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: holds a JSON {type(data).__name__}, not an object")
    return data


def gains_report(done: dict, title: str) -> str:
    """Markdown: the tuned config against the default at every point of the sweep (on a GPU
    their medians of the final rounds, ``final_ranking``), and the gain per kernel."""
    lines = [f"# {title}", "",
             "At the end of the same sweep, each point's default and its fastest configs "
             "were checked and timed again in interleaved rounds (`tune.final_ranking`; "
             "the table's `sweep` says how many); the figures are the medians of those "
             "rounds (each a CUDA-graph median, µs).", "",
             "| kernel | shape | b | default µs | tuned µs | gain | tuned keys (default's) |",
             "|---|---|---|---|---|---|---|"]
    per_kernel = {}
    for kernel, shapes in done.items():
        for shape, buckets in shapes.items():
            for b in sorted(buckets, key=int):
                c = buckets[b]
                gain = c["_default_us"] / c["_us"]
                per_kernel.setdefault(kernel, []).append(gain)
                lines.append(f"| {kernel} | {shape} | {b} | {c['_default_us']:.1f} | "
                             f"{c['_us']:.1f} | {gain:.2f}x | {c.get('_changed', '')} |")
    lines += ["", "| kernel | points | gain (geometric mean) | least | most |",
              "|---|---|---|---|---|"]
    for kernel, gains in per_kernel.items():
        mean = 1.0
        for g in gains:
            mean *= g ** (1 / len(gains))
        lines.append(f"| {kernel} | {len(gains)} | {mean:.2f}x | {min(gains):.2f}x | "
                     f"{max(gains):.2f}x |")
    return "\n".join(lines) + "\n"
