"""`hybridrec preprocess` as a script: the Beam preprocessing job."""

import sys

import hybridrec.cli

if __name__ == "__main__":
    sys.exit(hybridrec.cli.main(["preprocess", *sys.argv[1:]]))
