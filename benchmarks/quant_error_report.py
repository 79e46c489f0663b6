"""Tables and a plot from `benchmarks/quant_error.py`'s results.json (CPU, numpy-free, matplotlib for the plot).

    python benchmarks/quant_error_report.py docs/quant_error      # -> tables.md, per_layer.png next to results.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
STATS = ("rel_error", "mean_over_std", "slope", "corr_error_w", "zero_share")


def layer_and_projection(name: str) -> tuple[int, str]:
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]), parts[-1]


def mean_by(stats: dict[str, dict], key, stat: str) -> dict:
    groups: dict = {}
    for name, row in stats.items():
        groups.setdefault(key(name), []).append(row[stat])
    return {k: statistics.fmean(v) for k, v in sorted(groups.items())}


def table(header: list[str], rows: list[list]) -> str:
    cell = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


def weights_tables(r: dict) -> str:
    out = ["### Weights: mean over the 210 decoder projections", "",
           table(["format"] + list(STATS),
                 [[f] + [statistics.fmean(v[s] for v in r["weights"][f].values()) for s in STATS]
                  for f in r["formats"] + r.get("probes", [])])]
    for stat in ("rel_error", "slope", "mean_over_std"):
        out += ["", f"### Weights: {stat} by projection type (mean over 30 layers)", "",
                table(["format"] + list(PROJECTIONS),
                      [[f] + [mean_by(r["weights"][f], lambda n: layer_and_projection(n)[1], stat)[p] for p in PROJECTIONS]
                       for f in r["formats"]])]
    return "\n".join(out)


def policy_tables(r: dict) -> str:
    out = []
    for kind, rows in r["policy"].items():
        tokens = rows["dense"]["tokens"]
        out += ["", f"### Policy along the dense model's {kind} completions ({r['setup']['prompts']} prompts, "
                    f"{tokens} tokens)", "",
                table(["format", "entropy (nats/token)", "KL(dense‖format) per token", "KL p90", "top-1 agreement",
                       "log-prob of the dense tokens"],
                      [[f, v["entropy"], v["kl"], v["kl_p90"], v["top1_agree"], v["token_logprob"]] for f, v in rows.items()])]
    return "\n".join(out)


def own_samples_table(r: dict) -> str:
    rows = r.get("own_samples", {})
    n = r["setup"]["prompts"]
    return "\n".join(["", f"### Each format along its own sampled completions (T = 1, seed {r['setup']['seed']}, {n} prompts: "
                           "the seed study's step-0 measurement)", "",
                      table(["format", "entropy (nats/token)", "KL(dense‖format) per token", "tokens per completion",
                             "sampled reward", "greedy accuracy"],
                            [[f, v["entropy"], v["kl"], v["completion_tokens"], v["sampled_reward"], v["greedy_accuracy"]]
                             for f, v in rows.items()])])


def sensitivity_tables(r: dict) -> str:
    s = r["sensitivity_nvfp4"]
    base = r["policy"]["sampled"]["dense"]["entropy"]  # over all prompts; the sensitivity uses the first ones
    out = ["", f"### NVFP4 on one projection type (all layers), the rest dense ({s['prompts']} sampled completions, "
               f"{s['tokens']} tokens)", "",
           table(["projection", "KL", "entropy"], [[p, v["kl"], v["entropy"]] for p, v in s["projection"].items()]),
           "", f"### NVFP4 on one layer (all 7 projections), the rest dense: the layers by KL", "",
           table(["layer", "KL", "entropy", "top-1 agreement"],
                 [[k, v["kl"], v["entropy"], v["top1_agree"]]
                  for k, v in sorted(s["layer"].items(), key=lambda kv: -kv[1]["kl"])]),
           "", f"(dense entropy along these completions: {s['dense']['entropy']:.4f}; along all "
               f"{r['setup']['prompts']}: {base:.4f})"]
    return "\n".join(out)


def codec_table(r: dict) -> str:
    rows = [[c["weight"], c["dtype"], c["global_scale_qerl"], c["global_scale_ref"], c["values_differ_vs_ref"],
             c["scales_differ_vs_ref"], max(c.get("bytes_differ_vs_ct", {"-": float("nan")}).values()),
             c["rel_error_qerl"], c["rel_error_ref"], c.get("rel_error_ct", float("nan"))] for c in r["codec"]]
    return "\n".join(["", "### NVFP4 codec: qerl vs the reference rounding vs compressed-tensors", "",
                      table(["weight", "dtype", "global scale (qerl)", "global scale (reference)",
                             "values differ vs ref", "scales differ vs ref", "bytes differ vs CT (max over tensors)",
                             "rel. error qerl", "rel. error ref", "rel. error CT"], rows)])


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    layer = lambda n: layer_and_projection(n)[0]  # noqa: E731
    for f in r["formats"]:
        if f == "bf16-rounded":
            continue
        errors = mean_by(r["weights"][f], layer, "rel_error")
        axes[0].plot(list(errors), list(errors.values()), marker="o", ms=3, label=f)
        slopes = mean_by(r["weights"][f], layer, "slope")
        axes[1].plot(list(slopes), list(slopes.values()), marker="o", ms=3, label=f)
    axes[0].set_ylabel("||W_q - W|| / ||W||\n(mean over 7 projections)")
    axes[0].legend(ncol=4, fontsize=8)
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[1].set_ylabel("slope <W_q,W>/<W,W>\n(< 1: shrinks)")
    s = r["sensitivity_nvfp4"]["layer"]
    layers = sorted(int(k) for k in s)
    ax = axes[2]
    ax.bar(layers, [s[str(k)]["kl"] for k in layers], color="tab:blue", label="KL(dense‖one layer NVFP4)")
    ax.set_ylabel("KL per token (nats)")
    twin = ax.twinx()
    dense = r["sensitivity_nvfp4"]["dense"]["entropy"]
    twin.plot(layers, [s[str(k)]["entropy"] - dense for k in layers], color="tab:red",
              marker=".", label="entropy change")
    twin.axhline(0.0, color="tab:red", lw=0.6, ls=":")
    twin.set_ylabel("entropy − dense (nats/token)", color="tab:red")
    ax.set_xlabel("decoder layer")
    ax.set_title("NVFP4 on one layer at a time (sampled completions)", fontsize=9)
    fig.suptitle("SmolLM2-135M: per-layer weight error by format, and NVFP4's per-layer effect on the policy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(folder: str) -> int:
    out = Path(folder)
    r = json.loads((out / "results.json").read_text())
    (out / "tables.md").write_text("\n\n".join([weights_tables(r), policy_tables(r), own_samples_table(r), sensitivity_tables(r),
                                                codec_table(r)]) + "\n")
    plot(r, out / "per_layer.png")
    print(f"wrote {out / 'tables.md'}, {out / 'per_layer.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else "docs/quant_error"))
