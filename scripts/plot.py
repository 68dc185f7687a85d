"""`hybridrec plot` as a script: python scripts/plot.py --help."""

import sys

import hybridrec.cli

if __name__ == "__main__":
    sys.exit(hybridrec.cli.main(["plot", *sys.argv[1:]]))
