"""Random ids of our own: never the script's random numbers.

Every trace and span id we choose, and every random draw of the SDK parts we
configure (our provider's id generator, our metric exemplar reservoirs), comes
from :data:`RNG`, a private ``random.Random`` seeded from ``os.urandom``. The
global ``random`` (the OTel SDK's ``RandomIdGenerator`` and its exemplar
reservoir draw from it) is never touched, so a seeded script draws the same
numbers traced or not, and seeding it (``random.seed``, Lightning's
``seed_everything``) has no effect on our ids: ranks seeded alike still get
distinct ids. A forked child reseeds at once (``os.register_at_fork``), so it
never repeats its parent's ids; a spawned process seeds itself.

Pure Python, no torch or SDK import.
"""

from __future__ import annotations

import os
import random

RNG = random.Random()  # seeded from os.urandom; getrandbits and randrange are thread-safe C calls


def _reseed() -> None:
    RNG.seed()  # os.urandom again: the child's ids are not its parent's


os.register_at_fork(after_in_child=_reseed)


def span_id() -> int:
    """A random 64-bit span id, never 0 (invalid in OTel)."""
    return RNG.getrandbits(64) or 1


def trace_id() -> int:
    """A random 128-bit trace id, never 0 (invalid in OTel)."""
    return RNG.getrandbits(128) or 1
