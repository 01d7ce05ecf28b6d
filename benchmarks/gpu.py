"""GPU benchmark: split training at real size in bf16 — step time, caching throughput, memory.

One command, on one CUDA GPU, in under 8 minutes (``--budget`` shortens the timed rounds to fit):

    python -m benchmarks.gpu                        # sd15 and flux, bf16, results in --out
    python -m benchmarks.gpu --mixes sd15 --rounds 10
    python -m benchmarks.gpu --dry-run              # CPU, tiny configs, float32: checks the script

For each mix (:mod:`benchmarks.gpu_mixes`: SD-1.5-size and Flux-size, random weights):

1. **split**: ``graphsplit.split(step, batch)`` on the device's models; then one batch through
   the unsplit step, through ``stage2(**stage1(batch))`` and through the hand-written step from
   one seed, and whether the three losses are bit-identical.
2. **caching**: ``graphsplit.cache`` over ``RandomSamples`` (a DataLoader with pinned memory):
   samples/s and the mean GPU utilisation while it runs, against stage 1 alone on the same
   loader (no writing). ``writer_share`` = stage-1-only time / cache time: 1.0 means the writer
   is never the bottleneck.
3. **step time**, forward + backward, interleaved rounds (:func:`benchmarks.common.interleaved`),
   synchronised: ``unsplit`` (raw batch), ``stage2`` (boundary tensors already on the GPU),
   ``stage2_from_cache`` (the next batch of ``DataLoader(CachedDataset, collate_fn=collate,
   pin_memory=True)``, copied to the GPU ``non_blocking`` on a side stream while the previous
   step runs), ``hand_written`` (the denoiser-only step on precomputed tensors already on the
   GPU). Ratios are medians of same-round ratios, with IQR.
4. **peak GPU memory** of each variant as a process running only it would need: the bytes of
   the parameters and buffers it holds (stage 2 holds no frozen encoder) plus the peak
   allocated above the resting level while one step runs. All variants share one process here,
   so the resting level holds every model; the accounting removes what a variant does not hold.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    environment,
    interleaved,
    markdown_table,
    parser,
    report,
    timing_options,
    torch_threads,
    write_results,
)
from benchmarks.gpu_mixes import MIXES, Mix, build_mix

# stage 2 and the hand-written step sit next to each other in both orders of a round.
VARIANTS = ("stage2", "hand_written", "stage2_from_cache", "unsplit")
RATIOS = {
    "stage2_over_hand_written": ("stage2", "hand_written"),
    "from_cache_over_hand_written": ("stage2_from_cache", "hand_written"),
    "speedup": ("unsplit", "stage2_from_cache"),
    "ideal_speedup": ("unsplit", "hand_written"),
}
BUDGET_SECONDS = 450.0  # 7.5 minutes of the 8 allowed


class Clock:
    """Seconds since the start, and how many of the budget are left."""

    def __init__(self, budget: float) -> None:
        self.start, self.budget = time.perf_counter(), budget

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.budget - self.elapsed()

    def say(self, text: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {text}", flush=True)


class Utilization:
    """Mean GPU utilisation (%) while a block runs, sampled every ``period`` seconds.

    Reads ``torch.cuda.utilization`` (needs pynvml), else ``nvidia-smi``; ``mean`` is None on
    a CPU or where neither can be read.
    """

    def __init__(self, device: torch.device, period: float = 0.2) -> None:
        self.device, self.period = device, period
        self.samples: list[float] = []
        self.source: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Utilization:
        if self.device.type == "cuda":
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def mean(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            value = self._read()
            if value is None:
                return
            self.samples.append(value)

    def _read(self) -> float | None:
        if self.source in (None, "torch"):
            try:
                value = float(torch.cuda.utilization(self.device))
                self.source = "torch"
                return value
            except Exception:  # pynvml missing or unusable: try nvidia-smi
                self.source = "nvidia-smi"
        properties = torch.cuda.get_device_properties(self.device)
        gpu = f"GPU-{properties.uuid}" if hasattr(properties, "uuid") else str(self.device.index)
        try:
            text = subprocess.run(
                ["nvidia-smi", f"--id={gpu}", "--query-gpu=utilization.gpu",
                 "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=5, check=True,
            ).stdout  # fmt: skip
            return float(text.split()[0])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            self.source = None
            return None


class DevicePrefetcher:
    """Endless batches on ``device`` from a loader: while the caller computes on batch ``n``,
    batch ``n + 1`` (pinned by the loader) is copied with ``non_blocking=True`` on a side
    stream; ``next()`` makes the compute stream wait for that copy only."""

    def __init__(self, loader: Any, device: torch.device) -> None:
        self.loader, self.device = loader, device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._batches = iter(loader)
        self._ready = self._copy()

    def _copy(self) -> dict[str, torch.Tensor]:
        try:
            batch = next(self._batches)
        except StopIteration:  # the next epoch
            self._batches = iter(self.loader)
            batch = next(self._batches)
        if self.stream is None:
            return {name: value.to(self.device) for name, value in batch.items()}
        with torch.cuda.stream(self.stream):
            return {name: value.to(self.device, non_blocking=True) for name, value in batch.items()}

    def next(self) -> dict[str, torch.Tensor]:
        batch = self._ready
        if self.stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.stream)
            for value in batch.values():
                value.record_stream(current)  # its memory is not reused before the step ends
        self._ready = self._copy()
        return batch


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _held_bytes(*modules: torch.nn.Module) -> int:
    """Bytes of the distinct real tensors (parameters and buffers) the modules hold."""
    seen: dict[int, int] = {}
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.device.type != "meta":
                storage = tensor.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _loader(dataset: Any, batch_size: int, device: torch.device, **options: Any) -> Any:
    workers = 2 if device.type == "cuda" else 0
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=workers,
        persistent_workers=workers > 0,
        pin_memory=device.type == "cuda",
        **options,
    )


def _inputs(batch: dict[str, Any], names: tuple[str, ...], device: torch.device) -> dict:
    return {name: batch[name].to(device, non_blocking=True) for name in names}


def measure_mix(name: str, options: argparse.Namespace, clock: Clock, folder: Path) -> dict:
    """All four measurements of one mix (see the module docstring)."""
    device, dtype = torch.device(options.device), getattr(torch, options.dtype)
    row: dict[str, Any] = {"mix": name, "device": str(device), "dtype": options.dtype}
    started = time.perf_counter()
    mix = build_mix(name, tiny=options.dry_run, device=device, dtype=dtype)
    _synchronize(device)
    row["build_seconds"] = time.perf_counter() - started
    row["params_billion"] = sum(p.numel() for p in mix.step.parameters()) / 1e9
    row["trainable_params_million"] = (
        sum(p.numel() for p in mix.step.parameters() if p.requires_grad) / 1e6
    )
    row["batch_size"], row["resolution"] = mix.shape.batch_size, mix.shape.resolution
    clock.say(f"{name}: built {row['params_billion']:.2f} B parameters")

    dataset = mix.dataset(dtype)
    first = torch.utils.data.default_collate([dataset[i] for i in range(mix.shape.batch_size)])
    started = time.perf_counter()
    split = _split(mix, first, device)
    row["split_seconds"] = time.perf_counter() - started
    batch = _inputs(first, split.input_names, device)
    row["boundary"] = {key: list(spec.shape) for key, spec in split.boundary.items()}
    row["losses"] = _losses(mix, split, batch)
    clock.say(f"{name}: split in {row['split_seconds']:.1f} s; losses {row['losses']}")

    row["caching"] = _caching(mix, split, dataset, device, folder)
    clock.say(f"{name}: cached {row['caching']['samples_per_second']:.1f} samples/s")

    timed = _step_times(mix, split, batch, folder, device, options, clock)
    row.update(timed)
    clock.say(f"{name}: stage2 / hand {row['wall']['stage2_over_hand_written']['median']:.3f}")
    return row


def _split(mix: Mix, first: dict[str, Any], device: torch.device) -> Any:
    import graphsplit

    names = [name for name in first if name != "key"]
    return graphsplit.split(mix.step, tuple(first[name].to(device) for name in names))


def _losses(mix: Mix, split: Any, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One batch through the three ways from one seed; the losses and whether they agree."""
    with torch.no_grad():
        values = {}
        torch.manual_seed(0)
        values["unsplit"] = mix.step(**batch).item()
        torch.manual_seed(0)
        values["stage2"] = split.stage2(**split.stage1(**batch)).item()
        torch.manual_seed(0)
        values["hand_written"] = mix.hand_loss(**mix.hand_inputs(batch)).item()
    return {**values, "bit_identical": len(set(values.values())) == 1}


def _caching(mix: Mix, split: Any, dataset: Any, device: torch.device, folder: Path) -> dict:
    import graphsplit

    loader = _loader(dataset, mix.shape.batch_size, device)
    with Utilization(device) as stage1_busy:
        started = time.perf_counter()
        with torch.inference_mode():
            for batch in loader:
                split.stage1(**_inputs(batch, split.input_names, device))
        _synchronize(device)
        stage1_seconds = time.perf_counter() - started
    from graphsplit.caching.format.fingerprint import fingerprint

    started = time.perf_counter()
    fingerprint(split)  # what cache() pays once per call, before its first batch
    fingerprint_seconds = time.perf_counter() - started
    target = folder / f"cache-{mix.name}"
    with Utilization(device) as caching_busy:
        started = time.perf_counter()
        info = graphsplit.cache(split, loader, target, progress=False)
        cache_seconds = time.perf_counter() - started
    return {
        "samples": len(dataset),
        "cache_seconds": cache_seconds,
        "stage1_only_seconds": stage1_seconds,
        "fingerprint_seconds": fingerprint_seconds,
        "samples_per_second": len(dataset) / cache_seconds,
        "samples_per_second_after_fingerprint": len(dataset)
        / max(cache_seconds - fingerprint_seconds, 1e-9),
        "stage1_only_samples_per_second": len(dataset) / stage1_seconds,
        "writer_share": stage1_seconds / cache_seconds,
        "bytes": info.total_bytes,
        "mb_per_second": info.total_bytes / cache_seconds / 1e6,
        "gpu_utilization_percent": caching_busy.mean,
        "stage1_only_gpu_utilization_percent": stage1_busy.mean,
        "utilization_source": caching_busy.source,
        "path": str(target),
    }


def _step_times(mix, split, batch, folder, device, options, clock) -> dict[str, Any]:
    import graphsplit

    boundary = {name: value.detach() for name, value in split.stage1(**batch).items()}
    hand = mix.hand_inputs(batch)
    # Without ``split``: this process wrote the cache a moment ago, and the fingerprint check
    # would hash every frozen weight again (timed once in the caching phase).
    cached = graphsplit.CachedDataset(folder / f"cache-{mix.name}")
    loader = _loader(cached, mix.shape.batch_size, device, shuffle=True, drop_last=True,
                     collate_fn=graphsplit.collate)  # fmt: skip
    prefetcher = DevicePrefetcher(loader, device)
    losses = {
        "unsplit": lambda: mix.step(**batch),
        "stage2": lambda: split.stage2(**boundary),
        "stage2_from_cache": lambda: split.stage2(**prefetcher.next()),
        "hand_written": lambda: mix.hand_loss(**hand),
    }

    def run(name: str) -> None:
        losses[name]().backward()
        _synchronize(device)

    def before_each(name: str, index: int) -> None:
        mix.step.zero_grad(set_to_none=True)
        torch.manual_seed(index)

    variants = {name: (lambda name=name: run(name)) for name in VARIANTS}
    warm = interleaved(variants, rounds=1, warmup=1, before_each=before_each)
    round_seconds = sum(warm.seconds(name)[0] for name in VARIANTS)
    # Leave a share of the budget to the mixes still to come and to the memory pass.
    room = clock.left() / options.mixes_left - 2 * round_seconds
    rounds = min(options.rounds, max(3, int(room / max(round_seconds, 1e-9))))
    clock.say(f"{mix.name}: {rounds} rounds of {round_seconds:.2f} s")
    timings = interleaved(variants, rounds=rounds, warmup=0, before_each=before_each)
    result: dict[str, Any] = {"rounds": rounds, "timings": timings.to_json()}
    for clock_name in ("wall", "cpu"):
        result[clock_name] = {
            "median_seconds": {n: timings.spread(n, clock_name).median for n in VARIANTS},
            **{key: timings.ratio(a, b, clock_name).to_json() for key, (a, b) in RATIOS.items()},
        }
    held = {
        "unsplit": _held_bytes(mix.step),
        "stage2": _held_bytes(split.stage2),
        "stage2_from_cache": _held_bytes(split.stage2),
        "hand_written": _held_bytes(mix.denoiser),
    }
    result["memory"] = {
        name: _peak(name, run, before_each, held[name], device) for name in VARIANTS
    }
    return result


def _peak(name, run, before_each, held: int, device: torch.device) -> dict[str, Any]:
    """What a process running only ``name`` would need, in GiB (see the module docstring)."""
    before_each(name, 0)
    if device.type != "cuda":  # no allocator statistics: the weights only
        return {"held_gib": held / 2**30, "step_gib": None, "total_gib": None}
    _synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    resting = torch.cuda.memory_allocated(device)
    run(name)
    step = torch.cuda.max_memory_allocated(device) - resting
    return {"held_gib": held / 2**30, "step_gib": step / 2**30, "total_gib": (held + step) / 2**30}


def _cell(value: dict[str, float] | None, spec: str = ".3f") -> str:
    if value is None:
        return "–"
    return f"{value['median']:{spec}} ({value['q1']:{spec}}–{value['q3']:{spec}})"


def _number(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def to_markdown(rows: list[dict[str, Any]]) -> str:
    """Three tables: step time, caching, memory; one row per mix."""
    steps = [["mix", "batch × px", "unsplit s", "stage 2 s", "stage 2 from cache s",
              "hand-written s", "stage2 / hand", "from cache / hand", "speed-up", "ideal",
              "losses bit-identical"]]  # fmt: skip
    caching = [["mix", "samples", "samples/s", "after fingerprint", "stage 1 alone",
                "writer share (1 = never the bottleneck)", "MB/s", "GPU util %",
                "fingerprint s"]]  # fmt: skip
    memory = [["mix", *(f"{name} GiB (held + step)" for name in VARIANTS)]]
    for row in rows:
        if "wall" not in row:
            continue
        m, w, c = row["wall"]["median_seconds"], row["wall"], row["caching"]
        steps.append([
            row["mix"], f"{row['batch_size']} × {row['resolution']}", f"{m['unsplit']:.4f}",
            f"{m['stage2']:.4f}", f"{m['stage2_from_cache']:.4f}", f"{m['hand_written']:.4f}",
            _cell(w["stage2_over_hand_written"]), _cell(w["from_cache_over_hand_written"]),
            _cell(w["speedup"], ".2f"), _cell(w["ideal_speedup"], ".2f"),
            str(row["losses"]["bit_identical"]),
        ])  # fmt: skip
        caching.append([
            row["mix"], c["samples"], f"{c['samples_per_second']:.1f}",
            f"{c['samples_per_second_after_fingerprint']:.1f}",
            f"{c['stage1_only_samples_per_second']:.1f}", f"{c['writer_share']:.2f}",
            f"{c['mb_per_second']:.1f}", _number(c["gpu_utilization_percent"], ".0f"),
            f"{c['fingerprint_seconds']:.1f}",
        ])  # fmt: skip
        memory.append([row["mix"], *(
            f"{_number(row['memory'][n]['total_gib'], '.2f')} "
            f"({row['memory'][n]['held_gib']:.2f} + {_number(row['memory'][n]['step_gib'], '.2f')})"
            for n in VARIANTS)])  # fmt: skip
    failed = [f"- {row['mix']}: {row['status']}" for row in rows if row.get("status") != "ok"]
    return "\n".join([
        "Step time, forward + backward; seconds are medians, ratios median (IQR) of same-round "
        "ratios", "", markdown_table(steps[0], steps[1:], "l" * len(steps[0])),
        "Stage-1 caching", "", markdown_table(caching[0], caching[1:], "l" * len(caching[0])),
        "Peak GPU memory of a process running only that variant", "",
        markdown_table(memory[0], memory[1:], "l" * len(memory[0])), *failed, "",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    command = timing_options(parser("gpu", __doc__), rounds=20)
    command.add_argument("--mixes", nargs="+", choices=MIXES, default=list(MIXES))
    command.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU, tiny configs, float32, 1 round: checks the script without a GPU",
    )
    command.add_argument("--device", default="cuda", help="default: cuda (cpu with --dry-run)")
    command.add_argument(
        "--dtype", help="model and data dtype (default: bfloat16; float32 with --dry-run)"
    )
    command.add_argument(
        "--budget",
        type=float,
        default=BUDGET_SECONDS,
        help=f"seconds for the whole run; rounds shrink to fit (default {BUDGET_SECONDS:.0f})",
    )
    command.add_argument("--dir", type=Path, help="where to write the caches (default: temp)")
    options = command.parse_args(argv)
    if options.dry_run or options.quick:  # --quick, every script's smoke test, is the dry run
        options.dry_run, options.device, options.rounds = True, "cpu", 1
        options.dtype = options.dtype or "float32"
    elif not torch.cuda.is_available():
        command.error("no CUDA device: run on a GPU machine, or pass --dry-run to check the script")
    options.dtype = options.dtype or "bfloat16"
    _quiet_libraries()
    clock = Clock(options.budget)
    folder = Path(tempfile.mkdtemp(prefix="graphsplit-gpu-", dir=options.dir))
    rows = []
    try:
        with torch_threads(options.threads):
            for index, name in enumerate(options.mixes):
                options.mixes_left = len(options.mixes) - index
                rows.append(_guarded(name, options, clock, folder))
                shutil.rmtree(folder / f"cache-{name}", ignore_errors=True)
                if options.device.startswith("cuda"):
                    torch.cuda.empty_cache()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    where = environment("graphsplit", "torch", "diffusers", "transformers", "peft")
    if torch.cuda.is_available() and not options.dry_run:
        where["gpu"] = torch.cuda.get_device_name(torch.device(options.device))
    where["total_seconds"] = clock.elapsed()
    write_results(options.out, "gpu", report("gpu", rows, where), to_markdown(rows))
    return 0 if all(row["status"] == "ok" for row in rows) else 1


def _guarded(name: str, options: argparse.Namespace, clock: Clock, folder: Path) -> dict:
    """One mix; a failure (out of memory, a graphsplit error on CUDA) is a row, not a crash."""
    try:
        return {**measure_mix(name, options, clock, folder), "status": "ok"}
    except Exception as exc:  # the other mix still runs, and the failure is in the results
        clock.say(f"{name}: FAILED {type(exc).__name__}: {exc}")
        return {"mix": name, "status": f"failed: {type(exc).__name__}: {exc}"}


def _quiet_libraries() -> None:
    """diffusers warns on every ``.to(dtype)`` of a randomly initialised model."""
    from diffusers.utils import logging

    logging.set_verbosity_error()


if __name__ == "__main__":
    raise SystemExit(main())
