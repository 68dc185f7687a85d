"""`hybridrec evaluate` as a script: python scripts/evaluate.py --help."""

import sys

import hybridrec.cli

if __name__ == "__main__":
    sys.exit(hybridrec.cli.main(["evaluate", *sys.argv[1:]]))
