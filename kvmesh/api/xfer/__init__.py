"""Generated from proto/: do not edit. Regenerate with tools/gen_protos.py."""
