"""Real inference engines' cache managers, run as child processes of the lab.

Each module here is a program for another interpreter (an engine's own
virtualenv, with its pins and its torch) that the lab starts and talks to in
lines; none of them imports kvmesh, the services or the rest of the lab but
``lockstep.py`` (standard library only: the trace's tokens and the line protocol
they share).
"""
