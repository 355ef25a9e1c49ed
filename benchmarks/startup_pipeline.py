"""Start-up of `flatlm train` and the input pipeline's throughput (issue 17's last two CPU goals).

    .venv/bin/python benchmarks/startup_pipeline.py [--runs 3] [--batch 4096] [--batches 20] [--json]

Start-up: `flatlm train --config configs/pcfg_mlm.py:tiny` for one step, in a fresh workdir whose corpus is
already built (`data.data_dir` shared with a first, untimed run): seconds from launching the command to its first
step's metrics row (the row's wall-clock `time`), and to the command's exit; median of `--runs`; with JAX's
persistent compilation cache off (cold) and filled by the first run (warm: the CLI's default, `run.
enable_compilation_cache`). Also the import
of the CLI and the train verb alone, and the train step's XLA compile (from `JAX_LOG_COMPILES`): their sum is a
floor no overlap of the other start-up work goes below. Goal: first step < 5 s on a quiet machine.

Pipeline: the grain iterator `flatlm.data.pipeline.train_iterator` alone (shuffle, mask, batch; no model) at the
paper's batch of 4096 on the PCFG corpus of the tiny preset, and the stream source (sentences sampled and masked
on the fly), in tokens/s (B x T, padding included), median of `--batches` batches after one. The consumption it is
held against is a measured step: `benchmarks/RESULTS.md`'s H100 L12-H768 bf16 step at batch 4096 (595k tokens/s,
one device per host): goal >= 10x that per host.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _util import load_line

REPO = Path(__file__).resolve().parent.parent
FLATLM = [sys.executable, "-m", "flatlm.cli"]
STEP_TOKENS_PER_S = 595_000  # H100, L12-H768 bf16, batch 4096 (benchmarks/RESULTS.md, 2026-11-23)


STEP_COMPILE = re.compile(r"Finished XLA compilation of jit\(train_step\) in ([0-9.]+) sec")


def first_step_s(workdir: str, data_dir: str, cache: str) -> tuple[float, float, float]:
    """(launch -> first metrics row, launch -> exit, the train step's XLA compile) seconds of one `flatlm train`
    tiny, one step, with the compilation cache folder `cache` ("off": none); with the program in the cache, the
    "compile" JAX logs is the cache read."""
    cmd = FLATLM + ["train", "--config", "configs/pcfg_mlm.py:tiny", "--workdir", workdir, "--quiet",
                    "--config.train.steps=1", f"--config.data.data_dir={data_dir}"]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "FLATLM_COMPILATION_CACHE": cache, "JAX_LOG_COMPILES": "1"})
    end = time.time()
    rows = [json.loads(line) for line in Path(workdir, "metrics.jsonl").read_text().splitlines()]
    found = STEP_COMPILE.findall(proc.stderr)  # none: a JAX that logs otherwise; the floor is then not measured
    compile_s = sum(float(x) for x in found) if found else float("nan")
    return min(r["time"] for r in rows if r["step"] == 1) - t0, end - t0, compile_s


def import_s() -> float:
    """Seconds to import the CLI and the train verb in a fresh interpreter (minus the interpreter's start)."""
    def run(code):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        return time.perf_counter() - t
    return run("import flatlm.cli.main, flatlm.cli.train") - run("pass")


def startup(runs: int) -> dict:
    """Median start-up figures over `runs` fresh workdirs sharing one built corpus: without the compilation
    cache (cold: every compile) and with it (warm: the cache filled by an earlier run, the default CLI case)."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        data_dir, cache = os.path.join(tmp, "data"), os.path.join(tmp, "jax-cache")
        first_step_s(os.path.join(tmp, "build"), data_dir, cache)  # builds the corpus, fills the cache: not timed
        for name, c in (("cold", "off"), ("warm", cache)):
            t = np.array([first_step_s(os.path.join(tmp, f"{name}{i}"), data_dir, c) for i in range(runs)])
            out[name] = dict(first_step_s=float(np.median(t[:, 0])), exit_s=float(np.median(t[:, 1])),
                             first_step_all=t[:, 0].tolist(), step_compile_s=float(np.median(t[:, 2])))
    out["import_s"] = float(np.median([import_s() for _ in range(runs)]))
    return out


def pipeline_rate(batch: int, batches: int) -> dict:
    """tokens/s of the grain pipeline alone, tfds source and stream source, at `batch` sentences."""
    from flatlm.config import load_config  # reason: the package loads after the start-up timings
    from flatlm.data import pipeline  # reason: as above
    from flatlm.run import build_run  # reason: as above

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(str(REPO / "configs/pcfg_mlm.py:tiny"))
        config.data.train_size = max(config.data.train_size, 4 * batch)
        run = build_run(config, tmp, quiet=True)
        for source in ("tfds", "stream"):
            config.data.batch_size, config.data.source = batch, source
            it = pipeline.train_iterator(config.data, run.num_words, config.seed, source=run.sources.get("train"),
                                         language=run.language)
            first = next(it)
            times = []
            for _ in range(batches):
                t = time.perf_counter()
                next(it)
                times.append(time.perf_counter() - t)
            tokens = first["tokens"].size
            out[source] = dict(batch=batch, tokens_per_batch=tokens, tokens_per_s=tokens / float(np.median(times)))
    return out


def main(argv=None) -> int:
    """Run both parts and print them with their goals; returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    print(f"machine: {load_line()}", flush=True)
    s = startup(args.runs)
    for name in ("cold", "warm"):
        r = s[name]
        each = ", ".join(f"{x:.1f}" for x in r["first_step_all"])
        # imports, then the step's XLA compile, one after the other whatever else overlaps them (the step needs
        # jax, flax and the model): where their sum passes the goal, no other start-up work can meet it here
        floor = s["import_s"] + r["step_compile_s"]
        floor_text = ("the train step's XLA compile: not measured (no compile line in JAX's log)" if np.isnan(floor)
                      else f"imports {s['import_s']:.1f} s + the train step's XLA compile {r['step_compile_s']:.1f} s"
                      f" = {floor:.1f} s {'>=' if floor >= 5 else '<'} 5 s")
        print(f"flatlm train tiny, 1 step, corpus built, compilation cache {name}: first step "
              f"{r['first_step_s']:.1f} s after launch (median of {args.runs}: {each}), exit {r['exit_s']:.1f} s; "
              f"goal first step < 5 s: {'met' if r['first_step_s'] < 5 else 'MISSED'} ({floor_text})")
    print(f"imports of the CLI and the train verb: {s['import_s']:.1f} s", flush=True)
    p = pipeline_rate(args.batch, args.batches)
    for source, r in p.items():
        x = r["tokens_per_s"] / STEP_TOKENS_PER_S
        print(f"pipeline alone, {source} source, batch {r['batch']}: {r['tokens_per_s']:,.0f} tokens/s = {x:.2f}x "
              f"the H100 step's {STEP_TOKENS_PER_S:,} tokens/s; goal >= 10x: {'met' if x >= 10 else 'MISSED'}")
    print(f"machine at the end: {load_line()}")
    if args.json:
        print(json.dumps({"startup": s, "pipeline": p}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
