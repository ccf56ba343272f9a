"""``python -m meshkit.sweep merge DIR...``: rank several sweeps' trials as one table.

The slices of a sweep run as a SLURM job array (the sweep recipe's ``--slice I/N``)
each write a ``results.json``; this prints their trials ranked together and writes
them to ``--out`` (``merged.json`` in the current folder by default).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from meshkit.sweep._merge import merge_results, merged_table, write_merged


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshkit.sweep", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    merge = commands.add_parser("merge", help="rank several sweeps' trials as one table")
    merge.add_argument("sweeps", nargs="+", help="sweep workdirs (or their results.json)")
    merge.add_argument("--out", default="merged.json", help="where to write the merged JSON")
    merge.add_argument("--limit", type=int, default=None, help="print only the best N rows")
    args = parser.parse_args(argv)
    try:
        merged = merge_results(args.sweeps)
    except (ValueError, FileNotFoundError) as error:
        print(f"python -m meshkit.sweep merge: {error}", file=sys.stderr)
        return 2
    print(merged_table(merged, args.limit))
    trials, sweeps = len(merged["trials"]), len(merged["sources"])
    print(
        f"{trials} trial{'s' * (trials != 1)} from {sweeps} sweep{'s' * (sweeps != 1)}; "
        f"written to {write_merged(merged, args.out)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
