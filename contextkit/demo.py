"""``contextkit demo``: the main job on embedded defaults.

Until the layered-prompt pipeline and engine land, the demo measures the cache
the product stands on: TQ4 size and quality on the real SmolLM2 KV, and tier
moves against plain copies. It writes ``demo.json`` and ``demo.png`` under
``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from contextkit.bench import load

__all__ = ["plot_demo", "run_demo"]


def run_demo(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps: list[tuple[str, list[str]]] = [
        ("quant", []),
        ("tiers", ["--blocks", "512"]),
    ]
    results: dict[str, Any] = {}
    for name, argv in tqdm(steps, desc="demo", unit="step", file=sys.stderr):
        module = load(name)
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        results[name] = module.run(parser.parse_args(argv))
    (out / "demo.json").write_text(json.dumps(results, indent=2, sort_keys=True))
    png = plot_demo(results, out / "demo.png")
    q, t = results["quant"], results["tiers"]
    sys.stdout.write(
        "\nsummary\n-------\n"
        f"TQ4 stores {q['bytes_per_token_tq4']:,} bytes/token vs {q['bytes_per_token_fp16']:,} "
        f"for fp16 (Llama-3-8B shape), attention cosine on real SmolLM2 KV "
        f"{q.get('attn_cosine_real', float('nan')):.4f}.\n"
        f"Tier moves: warm {t['warm_gbps']:.2f} GB/s, spill {t['spill_gbps']:.2f} GB/s "
        f"({t['warm_ratio']:.2f} / {t['spill_ratio']:.2f} of a plain copy), "
        f"{t['copies_per_move']} copies per move.\n"
        f"Wrote {out / 'demo.json'} and {png}.\n"
    )
    return 0


def plot_demo(results: dict[str, Any], path: Path) -> Path:
    """Two panels: bytes per token by format, and tier-move bandwidth vs plain copies."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    q, t = results["quant"], results["tiers"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(q["shapes"])
    x = range(len(names))
    fp16 = [q["shapes"][n]["bytes_per_token_fp16"] / 1024 for n in names]
    tq4 = [q["shapes"][n]["bytes_per_token_tq4"] / 1024 for n in names]
    ax1.bar([i - 0.2 for i in x], fp16, width=0.4, label="fp16")
    ax1.bar([i + 0.2 for i in x], tq4, width=0.4, label="TQ4")
    ax1.set_xticks(list(x), names)
    ax1.set_ylabel("KiB per token (all layers, K+V)")
    ax1.set_title("KV bytes per token")
    ax1.legend()
    labels = ["warm", "plain h2d", "spill", "plain d2h"]
    values = [t["warm_gbps"], t["memcpy_h2d_gbps"], t["spill_gbps"], t["memcpy_d2h_gbps"]]
    ax2.bar(labels, values, color=["C0", "C7", "C1", "C7"])
    ax2.set_ylabel("GB/s")
    ax2.set_title(f"tier moves, {t['num_layers']} layers ({t['machine']['device_name']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
