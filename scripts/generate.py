"""`hybridrec generate` as a script: synthetic Criteo-format click logs."""

import sys

import hybridrec.cli

if __name__ == "__main__":
    sys.exit(hybridrec.cli.main(["generate", *sys.argv[1:]]))
