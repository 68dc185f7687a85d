"""Fixtures of the store tests."""

import pytest
from hybridrec.embedding_store.remote.shard_server import ShardServer


@pytest.fixture
def start_servers(request):
    """start_servers([[0, 1], [2]], num_shards=3, **kwargs) -> in-process shard servers of
    the test module's TABLES (or `tables=`); stopped at teardown."""
    started = []

    def start(layout, *, num_shards, tables=None, **kwargs):
        tables = request.module.TABLES if tables is None else tables
        servers = [
            ShardServer(tables, shards, num_shards=num_shards, **kwargs) for shards in layout
        ]
        started.extend(servers)
        return servers

    yield start
    for server in started:
        server.drain_and_stop(timeout=5)
