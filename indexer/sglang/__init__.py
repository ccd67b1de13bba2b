"""SGLang's external KV indexer API (kv_indexer.v1): its semantics and its gRPC server."""
