"""`hybridrec train` as a script: python scripts/train.py --help."""

import sys

import hybridrec.cli

if __name__ == "__main__":
    sys.exit(hybridrec.cli.main(["train", *sys.argv[1:]]))
