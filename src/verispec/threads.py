"""OpenMP worker pools across threads.

Every thread that enters a parallel region (a matmul, an attention call) keeps its own pool of OpenMP workers.
The engine runs its forwards on one thread; work done once on another thread (loading the model, building a
drafter) leaves a second pool behind, which is what `release_openmp_threads` frees.
"""

from __future__ import annotations

import ctypes


def release_openmp_threads() -> int:
    """Free the calling thread's OpenMP worker threads in every OpenMP runtime loaded (`omp_pause_resource_all`,
    soft); the number of runtimes that did. Linux only (the runtimes are found in /proc/self/maps); 0 elsewhere.

    Each thread that enters a parallel region keeps a pool of workers. libgomp counts every pool's threads, and
    once they outnumber the CPUs its workers stop spinning between regions and sleep instead: a step runs a
    parallel region per matmul and attention call, and waking the workers for each made the engine's steps 2.4x
    slower on its loop thread than on the thread that loaded the model (one-token step 3.6 vs 1.5 ms, Zen 5,
    2 vCPUs). The loading thread's pool, released once the
    model is ready, leaves the loop thread the only one with workers."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if any(k in line for k in ("libgomp", "libomp", "libiomp"))}
    except OSError:
        return 0
    released = 0
    for path in sorted(paths):
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        released += pause(1) == 0  # 1 = omp_pause_soft: the runtime starts new workers when next needed
    return released
