"""Remote shards: the store's tables served by `hybridrec serve-embeddings` over Arrow
Flight (the PERSIA layout). `client` is the trainer's side (the `Shard` protocol over the
wire, server address lists, `ServerSet`), `shard_server` the server's; `wire` and
`wire_rows` the record batches between them, with TLS and the token on both sides."""
