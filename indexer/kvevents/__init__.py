"""Engine event ingestion: vLLM/SGLang KV-event decoding and the ZMQ subscriber."""
