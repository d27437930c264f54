"""The table of scripts/bench/generation.py drawn as a bar chart: tok/s of each figure
(decode by batch, prefill by length, end to end), jaxkv beside each peer
and weight variant, the ratio to the peer over jaxkv's bar. Written next
to the JSON (out.json -> out.png)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def figures(res: dict[str, Any]) -> list[tuple[str, dict[str, float]]]:
    """(label, {system: tok/s}) per figure, in table order."""
    out = []
    for e in res["decode"].values():
        bars = {"jaxkv": e["jaxkv"]["tok_per_s"]}
        bars.update({f"jaxkv {k}": v["tok_per_s"] for k, v in e.get("variants", {}).items()})
        if "hf" in e:
            bars["hf"] = e["hf"]["tok_per_s"]
        out.append((f"decode\nbatch {e['batch']}", bars))
    for e in res["prefill"].values():
        bars = {"jaxkv": e["jaxkv"]["tok_per_s"]}
        if "hf" in e:
            bars["hf"] = e["hf"]["tok_per_s"]
        chunked = e.get("steps", 1) > 1
        out.append(
            (
                f"prefill {e['prompt_tokens']}"
                + (f"\n{e['steps']} x {e['token_budget']}" if chunked else ""),
                bars,
            )
        )
    b = res["e2e"]["batched"]["jaxkv"]
    out.append((f"e2e {res['e2e']['num_requests']}\nrequests", {"jaxkv": b["tok_per_s"]}))
    return out


def write_plot(res: dict[str, Any], path: Path | str) -> Path | None:
    """Draw the figures as grouped bars (log tok/s) into `path` (PNG);
    None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = figures(res)
    systems = list(dict.fromkeys(s for _, bars in figs for s in bars))
    colors = dict(zip(systems, ["#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]))
    if "hf" in colors:
        colors["hf"] = "#ff7f0e"
    width = 0.8 / len(systems)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.1 * len(figs)), 4.8), dpi=110)
    for j, sys_name in enumerate(systems):
        xs = [
            i + (j - (len(systems) - 1) / 2) * width
            for i, (_, b) in enumerate(figs)
            if sys_name in b
        ]
        ys = [b[sys_name] for _, b in figs if sys_name in b]
        ax.bar(xs, ys, width, label=sys_name, color=colors[sys_name])
        for x, y in zip(xs, ys):
            ax.text(x, y * 1.04, f"{y:.0f}", ha="center", va="bottom", fontsize=7)
    for i, (_, bars) in enumerate(figs):
        if "hf" in bars and bars["hf"]:
            ax.text(
                i,
                max(bars.values()) * 1.35,
                f"{bars['jaxkv'] / bars['hf']:.2f}x",
                ha="center",
                fontsize=8,
                weight="bold",
            )
    ax.set_yscale("log")
    ax.set_ylim(top=max(v for _, b in figs for v in b.values()) * 2.5)
    ax.set_xticks(range(len(figs)), [label for label, _ in figs], fontsize=8)
    ax.set_ylabel("tokens / s (log)")
    meta = res["meta"]
    ax.set_title(
        f"jaxkv vs {meta.get('peer') or 'nothing'}: {meta['model']}, "
        f"{meta['date'][:10]}, {meta['cpu']} ({meta['cores']} cores); "
        f"ratio = jaxkv / hf",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
