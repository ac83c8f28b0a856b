"""A small SVG line-plot emitter for the benchmarks (no plotting library needed): panels
stacked vertically, each with lines of (x, y) points, shared axis labels and a legend.

Local, pure Python; writes one file.
"""

from __future__ import annotations

from html import escape

W, H, LEFT, RIGHT, TOP, BOTTOM = 760, 190, 60, 150, 24, 34


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    step = (hi - lo) / n if hi > lo else 1.0
    return [lo + step * i for i in range(n + 1)]


def panels(path: str, plots: list[tuple[str, list[tuple[str, str, str, list]]]], *,
           x_label: str, y_label: str, y_max: float = 1.0) -> None:  # fmt: skip
    """Write ``plots`` (title, lines of (label, colour, dash pattern or "", [(x, y), ...]))
    to ``path`` as one SVG, a panel each, y from 0 to ``y_max``."""
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H * len(plots)}" '
        'font-family="sans-serif" font-size="11">',
        f'<rect width="{W}" height="{H * len(plots)}" fill="white"/>',
    ]
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM
    for k, (title, lines) in enumerate(plots):
        y0 = H * k + TOP
        x_hi = max((x for *_, pts in lines for x, _ in pts), default=1.0) or 1.0

        def px(x: float, _x_hi=x_hi) -> float:
            return LEFT + pw * x / _x_hi

        def py(y: float, _y0=y0) -> float:
            return _y0 + ph * (1 - min(y, y_max) / y_max)

        out.append(f'<text x="{LEFT}" y="{y0 - 8}" font-weight="bold">{escape(title)}</text>')
        out.append(f'<rect x="{LEFT}" y="{y0}" width="{pw}" height="{ph}" fill="none" '
                   'stroke="#888"/>')  # fmt: skip
        for t in _ticks(0, y_max, 4):
            out.append(f'<line x1="{LEFT - 4}" x2="{LEFT + pw}" y1="{py(t):.1f}" y2="{py(t):.1f}" '
                       'stroke="#ddd"/>')  # fmt: skip
            out.append(f'<text x="{LEFT - 6}" y="{py(t) + 4:.1f}" text-anchor="end">{t:g}</text>')
        for t in _ticks(0, x_hi):
            out.append(f'<text x="{px(t):.1f}" y="{y0 + ph + 14}" text-anchor="middle">'
                       f"{t:.0f}</text>")  # fmt: skip
        out.append(f'<text x="{LEFT + pw / 2}" y="{y0 + ph + 28}" text-anchor="middle">'
                   f"{escape(x_label)}</text>")  # fmt: skip
        out.append(f'<text x="14" y="{y0 + ph / 2}" transform="rotate(-90 14 {y0 + ph / 2})" '
                   f'text-anchor="middle">{escape(y_label)}</text>')  # fmt: skip
        for i, (label, colour, dash, pts) in enumerate(lines):
            d = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
            style = f' stroke-dasharray="{dash}"' if dash else ""
            out.append(f'<polyline points="{d}" fill="none" stroke="{colour}" '
                       f'stroke-width="1.3"{style}/>')  # fmt: skip
            ly = y0 + 12 + 16 * i
            out.append(f'<line x1="{W - RIGHT + 10}" x2="{W - RIGHT + 34}" y1="{ly}" y2="{ly}" '
                       f'stroke="{colour}" stroke-width="2"{style}/>')  # fmt: skip
            out.append(f'<text x="{W - RIGHT + 38}" y="{ly + 4}">{escape(label)}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
