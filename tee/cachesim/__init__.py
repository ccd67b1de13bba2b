"""The cache simulator: what a routed request stream would hit.

The tee forwards; the simulator measures.
"""
