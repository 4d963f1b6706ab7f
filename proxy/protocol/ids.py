"""Random ids that must be unique, not secret (request, response, item and call ids).

One private Mersenne Twister seeded from os.urandom, re-seeded in every forked child
(`serve --workers N`) so that workers never share a sequence: a getrandom() syscall per id
(secrets.token_hex) was a measurable share of the request path.
"""

from __future__ import annotations

import os
import random

_ids = random.Random()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_ids.seed)

random_bits = _ids.getrandbits  # random_bits(n) -> an int of n random bits
random_bytes = _ids.randbytes  # random_bytes(n) -> n random bytes
