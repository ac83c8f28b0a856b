"""bench_prefill's report: every rank's step records merged into one (each iteration counts its
slowest rank), the summary rows (p50/p99, the KV update's share, the difference vs the
baseline path), the markdown tables for BENCHMARKS.md and the plot. Pure logic on plain records
(matplotlib only in ``plot``, when installed); local, nothing to close.
"""

from __future__ import annotations

from typing import Any

from common import percentile

from .model import MODES
from .paths import BASELINE, PATHS

NAME = "bench_prefill"


def _pct(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return (a - b) / b * 100.0


def summarize(step_records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flat rows, one per (workload, mode, path) of every timed step: forward p50/p99/mean (ms),
    KV update alone p50/p99 (ms), its share of the forward (%), and the forward's difference vs
    the baseline path of the same step (%, None without the baseline)."""
    rows = []
    for st in step_records:
        if st.get("skipped"):
            continue
        base = st["paths"].get(BASELINE)
        base_p50 = percentile(base["forward_ms"], 50) if base else None
        for name in PATHS:
            got = st["paths"].get(name)
            if got is None:
                continue
            fwd, kv = got["forward_ms"], got["kv_ms"]
            p50, kv50 = percentile(fwd, 50), percentile(kv, 50)
            rows.append(
                {
                    "workload": st["workload"],
                    "tokens_per_rank": st["tokens_per_rank"],
                    "mode": st["mode"],
                    "path": name,
                    "forward_p50_ms": p50,
                    "forward_p99_ms": percentile(fwd, 99),
                    "forward_mean_ms": sum(fwd) / len(fwd),
                    "kv_p50_ms": kv50,
                    "kv_p99_ms": percentile(kv, 99),
                    "kv_share_pct": kv50 / p50 * 100.0 if p50 > 0 else None,
                    "vs_baseline_pct": _pct(p50, base_p50),
                    "tflops": st["flop_per_forward"] / (p50 * 1e-3) / 1e12 if p50 > 0 else None,
                    "iters": len(fwd),
                }
            )
    return rows


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def _md(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown(result: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The tables for BENCHMARKS.md: forwards, setup, growth, skipped steps."""
    out = []
    fwd = []
    for r in rows:
        vs = r["vs_baseline_pct"]
        pct = "baseline" if r["path"] == BASELINE else (None if vs is None else f"{vs:+.2f}%")
        share = None if r["kv_share_pct"] is None else f"{r['kv_share_pct']:.2f}%"
        fwd.append([r["workload"], r["tokens_per_rank"], r["mode"], r["path"],
                    r["forward_p50_ms"], r["forward_p99_ms"], r["kv_p50_ms"], share, pct])  # fmt: skip
    out.append(_md(["workload", "tokens/rank", "mode", "path", "forward p50 ms", "p99 ms",
                    "KV update alone p50 ms", "KV share", "vs vllm_gather p50"], fwd))  # fmt: skip
    setup = result.get("setup") or {}
    if setup:
        out.append("")
        out.append(_md(["setup (slowest rank)", "first ms", "second ms", "what"],
                       [[k, v.get("first_s", 0) * 1e3, v.get("second_s", 0) * 1e3, v["what"]]
                        for k, v in setup.items()]))  # fmt: skip
    growth = (result.get("growth") or {}).get("paths", {})
    grow_rows = []
    for k, v in growth.items():
        if isinstance(v, dict) and "total_s" in v:
            parts = ", ".join(f"{p} {_fmt(s * 1e3)}" for p, s in v.get("parts_s", {}).items())
            grow_rows.append([k, v["total_s"] * 1e3, parts or "-", v.get("check", "-")])
        elif isinstance(v, str):
            grow_rows.append([k, None, v, "-"])
    if grow_rows:
        out.append("")
        out.append(_md(["growth to 2x (slowest rank)", "total ms", "parts ms", "replay check"],
                       grow_rows))  # fmt: skip
    skipped = [s for s in result.get("steps", []) if s.get("skipped")]
    if skipped:
        out.append("")
    for s in skipped:
        if s["sequences"] == 1:
            alone = f"--tokens {s['tokens_per_rank']} --batch none"
        else:
            alone = f"--tokens none --batch {s['sequences']}x{s['seq_len']}"
        out.append(f"- skipped: {s['workload']} {s['mode']}: {s['skipped']} (alone: {alone} "
                   f"--modes {s['mode']})")  # fmt: skip
    return "\n".join(out)


def plot(path: str, rows: list[dict[str, Any]]) -> bool:
    """Forward difference vs the baseline and KV share per workload, one line per path and
    mode; False (and a printed line, no file) where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        print(f"{NAME}: matplotlib is not installed: no {path} (the JSON holds every number)")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["workload"] for r in rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode in MODES:
        for name in PATHS:
            pts = [r for r in rows if r["mode"] == mode and r["path"] == name]
            if not pts:
                continue
            xs = [labels.index(r["workload"]) for r in pts]
            style = "-o" if mode == "eager" else "--s"
            if name != BASELINE and any(r["vs_baseline_pct"] is not None for r in pts):
                left.plot(xs, [r["vs_baseline_pct"] for r in pts], style, label=f"{name} {mode}")
            right.plot(xs, [r["kv_share_pct"] for r in pts], style, label=f"{name} {mode}")
    for ax, title in ((left, f"forward p50 vs {BASELINE} (%)"),
                      (right, "KV update alone / forward p50 (%)")):  # fmt: skip
        ax.set_xticks(range(len(labels)), labels)
        ax.set_title(title)
        ax.axhline(0, color="grey", linewidth=0.5)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def merge_ranks(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One step record from every rank's: each timed iteration counts its slowest rank (ranks
    ran the same iterations in the same order); verification seconds likewise."""
    first = per_rank[0]
    merged = {k: v for k, v in first.items() if k not in ("paths", "verify")}
    if first.get("skipped"):
        return merged
    merged["verify"] = dict(first["verify"])
    merged["verify"]["forward_s"] = {
        p: max(r["verify"]["forward_s"][p] for r in per_rank) for p in first["verify"]["forward_s"]
    }
    merged["paths"] = {}
    for name in first["paths"]:
        merged["paths"][name] = {
            key: [max(vals) for vals in zip(*(r["paths"][name][key] for r in per_rank),
                                            strict=True)]
            for key in ("forward_ms", "kv_ms")
        }  # fmt: skip
    return merged
