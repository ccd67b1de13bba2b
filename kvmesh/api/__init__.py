"""Generated code only: the Python stubs of every proto in proto/ (tools/gen_protos.py).

Never edited by hand; `make gen` regenerates, `make check` fails when stale.
"""
