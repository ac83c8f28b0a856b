"""``python -m vmmkv {demo,doctor,bench}``."""

from __future__ import annotations

import sys

USAGE = """usage: python -m vmmkv COMMAND [options]

commands:
  demo     spawn a PCP group, publish KV rows directly into every replica, grow after
           CUDA-graph capture, verify byte for byte, report (host backend without a GPU)
  doctor   versions, VMM / fd / fabric / P2P support, and whether direct mode can work
  bench    store / barrier benchmark sweep with JSON output and a PNG plot
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from .demo import main as run
    elif cmd == "doctor":
        from .doctor import main as run
    elif cmd == "bench":
        from .bench import main as run
    else:
        print(f"unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
