"""Proposes DMT towers (`model.towers`) from a finished run: the Tower Partitioner.

Features whose learned embeddings interact strongly share a tower; every tower's lookup
load (distinct ids per batch) stays within `--tolerance` of the mean.

    python scripts/propose_towers.py --run runs/criteo --data data/criteo --towers 4
    hybridrec train ... --set 'model.towers=[[0, 1, 4], ...]'   # the printed line
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hybridrec.common.errors import UserError
from hybridrec.training.learned.partition import propose_towers_from_run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="a finished run directory")
    parser.add_argument("--data", type=Path, required=True, help="its preprocessed dataset")
    parser.add_argument("--towers", type=int, required=True, help="number of towers")
    parser.add_argument("--batch", type=int, default=512, help="examples per step (loads)")
    parser.add_argument("--tolerance", type=float, default=0.25, help="load excess allowed")
    args = parser.parse_args()
    try:
        towers, features = propose_towers_from_run(
            args.run, args.data, args.towers, batch_size=args.batch, tolerance=args.tolerance
        )
    except UserError as error:
        print(f"propose_towers: error: {error}", file=sys.stderr)
        return 2
    for index, tower in enumerate(towers):
        print(f"tower {index}: {', '.join(features[position] for position in tower)}")
    print(f"model.towers={json.dumps(towers)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
