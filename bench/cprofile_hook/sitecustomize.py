"""cProfile of the router's event-loop thread, switched on and off by SIGUSR1 (bench only).

`bench/profile_front_dynamo.py --cprofile` puts this folder first on the PYTHONPATH of
the processes it starts and sets PDMESH_CPROFILE_OUT; only a `services.router.main`
process installs the handler (PDMESH_CPROFILE_MODULE names another, e.g. the decode
workers', which then write one file each, suffixed with their PID). The first SIGUSR1 starts a `cProfile.Profile` on the
main thread (the event loop: every Python call there is counted, with no sampling;
times are the thread's CPU time),
the second stops it and writes the stats to PDMESH_CPROFILE_OUT. The signal is handled
between two bytecodes of the main thread, so it lands between callbacks of the loop.
"""

import os
import signal
import sys
import time

_OUT = os.environ.get("PDMESH_CPROFILE_OUT")
_MODULE = os.environ.get("PDMESH_CPROFILE_MODULE", "services.router.main")

if _OUT and _MODULE in sys.orig_argv:
    if _MODULE != "services.router.main":  # several processes (the decode workers): one file each
        _OUT = f"{_OUT}.{os.getpid()}"
    import cProfile

    _running: list[cProfile.Profile] = []

    def _toggle(signum, frame):
        if not _running:
            # CPU time of the thread, not wall time: a write that wakes the client (which then
            # takes this CPU) must not count as the writer's own time.
            prof = cProfile.Profile(time.thread_time_ns, 1e-9)
            _running.append(prof)
            prof.enable()
        else:
            prof = _running.pop()
            prof.disable()
            prof.dump_stats(_OUT + ".part")
            os.replace(_OUT + ".part", _OUT)  # whole, or not there

    signal.signal(signal.SIGUSR1, _toggle)
