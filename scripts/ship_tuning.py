"""Turn on-disk tuning caches into a table shipped with the package (``attn_ops/triton/tuned/``).

A tuning cache (``settings.cache_dir``, one ``tuning-*.json`` per GPU, Triton version and kernel source hash) holds
the configs timed on one machine. Shipped, the same configs serve every process on that GPU model with that Triton
release line as its first choice on a miss, in place of timing every candidate (``tuning.shipped``). Fill a cache
by running the workloads to cover (``attn_ops.pretune``, ``scripts/bench_blocks.py --varlen``, the benchmark sets)
with ``ATTN_ZOO_CACHE_DIR`` at an empty folder on the GPU, then:

    python scripts/ship_tuning.py CACHE_DIR_OR_FILE... --out attn_ops/triton/tuned/h100-triton3.6.json \\
        --measured "H100 80GB HBM3, torch 2.11, 2026-11-25: varlen run, crop set, blocks"

Every input must come from one GPU model and Triton release; an existing ``--out`` is merged into (the inputs win).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attn_ops.triton.tuning import Cfg, triton_release  # noqa: E402


def cache_files(paths):
    """The ``tuning-*.json`` files named or found in the folders named."""
    out = []
    for p in paths:
        out += sorted(glob.glob(os.path.join(p, "tuning-*.json"))) if os.path.isdir(p) else [p]
    if not out:
        raise SystemExit(f"ship_tuning: no tuning-*.json in {paths}")
    return out


def merge(files, previous=None):
    """(identity, configs) of the shipped table made from the cache ``files`` over ``previous`` (a shipped table's
    dict, or None). Raises ValueError when the files disagree on the GPU or the Triton release."""
    ident, configs = None, {}
    if previous is not None:
        ident, configs = previous["identity"], dict(previous["configs"])
    for path in files:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        this = {"gpu": data["identity"]["gpu"], "triton": triton_release(data["identity"]["triton"])}
        if ident is not None and this != ident:
            raise ValueError(f"{path} was tuned for {this}, the others for {ident}")
        ident = this
        for key, cfg in data["configs"].items():
            configs[key] = list(Cfg(*cfg))  # validates the shape of each entry
    return ident, configs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("caches", nargs="+", help="tuning cache folders or tuning-*.json files")
    ap.add_argument("--out", required=True, help="the shipped table to write (merged into if it exists)")
    ap.add_argument("--measured", required=True, help="where and when the configs were timed (kept in the file)")
    args = ap.parse_args(argv)
    previous = None
    if os.path.exists(args.out):
        with open(args.out, encoding="utf-8") as fh:
            previous = json.load(fh)
    ident, configs = merge(cache_files(args.caches), previous)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump({"identity": ident, "measured": args.measured, "configs": dict(sorted(configs.items()))}, fh,
                  indent=0)
        fh.write("\n")
    print(f"{args.out}: {len(configs)} configs for {ident}")


if __name__ == "__main__":
    main()
