"""The ``contextkit`` command: demo, status, recover, bench."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from contextkit._extras import MissingExtraError
from contextkit.bench import BENCHMARKS, load
from contextkit.models import ModelNotInstalledError
from gpu_cache import GPUCacheError
from shadow import ShadowError

__all__ = ["build_parser", "main"]


def _bench(args: argparse.Namespace) -> int:
    module = load(args.bench_name)
    result = module.run(args)
    if args.json:
        sys.stdout.write(json.dumps(result, sort_keys=True) + "\n")
    return 0


def _add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser("bench", help="run a benchmark (see `contextkit bench -h`)",
                           description="Benchmarks measured as ratios within one run.")
    names = bench.add_subparsers(dest="bench_name", metavar="NAME", required=True)
    for name in BENCHMARKS:
        module = load(name)
        p = names.add_parser(name, help=module.HELP, description=module.HELP)
        p.add_argument("--json", action="store_true",
                       help="print one JSON object as the last line of stdout")
        module.add_arguments(p)
        p.set_defaults(func=_bench)


def _demo(args: argparse.Namespace) -> int:
    from contextkit.demo import run_demo

    return run_demo(args)


def _recover(args: argparse.Namespace) -> int:
    from shadow.cli import run_recover

    result = run_recover(args)
    if args.json:
        sys.stdout.write(json.dumps(result, sort_keys=True) + "\n")
    return 1 if result.get("errors") else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="contextkit",
        description="Semantic control of a 4-bit tiered KV cache for agents.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = sub.add_parser(
        "demo", help="measure the TQ4 cache on the real SmolLM2 KV (bench quant + tiers) and plot",
        description="The main job on embedded defaults. Until the layered-prompt pipeline "
                    "lands it runs `bench quant` and `bench tiers` on the real model and writes "
                    "demo.json and demo.png under --out.")
    demo.add_argument("--out", default="runs/demo",
                      help="directory for the demo's JSON and PNG output (default: runs/demo)")
    demo.set_defaults(func=_demo)

    from shadow.cli import add_recover_arguments

    recover = sub.add_parser(
        "recover", help="restore shadowed sessions (run before serving)",
        description="Restore sessions shadowed to NVMe or S3 into the host tier, "
                    "re-pinning their stable prefixes.")
    add_recover_arguments(recover)
    recover.add_argument("--json", action="store_true",
                         help="print one JSON object as the last line of stdout")
    recover.set_defaults(func=_recover)

    _add_bench(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (MissingExtraError, ModelNotInstalledError, GPUCacheError, ShadowError) as exc:
        # Errors a user can fix: one line that says what to do, no traceback.
        sys.stderr.write(f"contextkit: error: {exc}\n")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
