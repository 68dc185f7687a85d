"""`hybridrec serve-embeddings`: host embedding shards behind an Arrow Flight server."""

import sys

import hybridrec.cli

if __name__ == "__main__":
    sys.exit(hybridrec.cli.main(["serve-embeddings", *sys.argv[1:]]))
